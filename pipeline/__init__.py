"""gradcomp.pipeline: pipeline-parallel training over compressed point-to-point links."""
