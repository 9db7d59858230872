"""What travels between processes: the typed specs and outputs that cross Ray's object store between
the ingress and the stage replicas (tensors as tensors), and the PNG/MP4 bytes frames become for the
client (encoded in the ingress replica)."""
