"""The sharing tiers of the prepare path: one module per way of handing out devices.

* :mod:`.protocol` - the `Tier` protocol and what a tier plans and applies (`TierPlan`,
  `PrepareRun`);
* :mod:`.state` - every key a tier records in a claim's checkpoint ``state``, with its typed
  reader;
* :mod:`.whole_gpu` - whole GPUs and static MIG devices, handed out as published;
* :mod:`.dynamic_mig` - MIG devices made at prepare and destroyed at unprepare;
* :mod:`.claim_mps` - one MPS control daemon per claim;
* :mod:`.mps_shares` - scheduler-accounted MPS shares of one shared daemon per device;
* :mod:`.capped_shares` - shares without MPS, memory capped by the driver;
* :mod:`.timeslicing` - time-slice intervals of full GPUs;
* :mod:`.assembly` - builds a node's tiers and declares their planning and acting orders.

No tier imports another: a tier reads what the others planned through `TierPlan`'s facts and
what they recorded through `.state`. Nothing here imports the tier modules, so the hardware-facing
packages below them (``mps``, ``mig``, `time_slicer`) may read `.state`. See
docs/architecture.md, "Prepare and unprepare".
"""
