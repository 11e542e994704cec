"""What the controller, the `gpu-dra` CLI and the kubelet plugin share to talk to Kubernetes.

API errors independent of the client library (`errors`), the client and its list helpers
(`client`), watch streams and the one watch request (`watch`), the list+watch loop
(`reflector`) and the log levels both daemons accept (`logs`). See docs/architecture.md#layers.
"""
