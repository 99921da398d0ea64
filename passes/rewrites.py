"""The ChunkIR rewrite passes, in pipeline order (filled in by the rewrite work)."""
CHUNK_PASSES: list = []
