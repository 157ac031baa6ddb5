"""Tier 2: replicas of every rank's snapshot in other nodes' memory.

- :mod:`.peer`       ``PeerReplicator``: what goes where (placement, double buffers, scan, fetches)
- :mod:`.transport`  ``Transport`` ABC: how a blob moves between two ranks (body, then MAGIC + tag)
- :mod:`.auth`       ``BlobSigner``: the HMAC-SHA256 tag of a blob with the checkpoint key (none: free)
- :mod:`.gloo`       ``GlooTransport``: point-to-point on the snapshot side group (the first implementation)
"""
