"""Publishing the node's ResourceSlices: the publisher, its write planner, API and metrics.

`publisher.SlicePublisher` keeps the node's pool published (reconcile on change, republish after a
kubelet wipe) with the writes `plan.plan_pool` computes, through `kubeapi.SliceApi`. See
docs/architecture.md#slice-publishing.
"""
