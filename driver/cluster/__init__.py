"""The cluster's DRA objects as the scheduler sees them (pure): pools, allocations, availability.

`state` builds the model from raw objects, `availability` says what is left of each device, `usage`
sums it up per node and per DeviceClass. Used by the `gpu-dra` CLI and the controller.
"""
