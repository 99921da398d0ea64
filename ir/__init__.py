"""qla's intermediate representations: RecurrenceIR, ChunkIR, KernelIR. Each prints and draws."""
