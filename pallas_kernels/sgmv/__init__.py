"""SGMV (segmented gather matrix-vector) kernels for multi-LoRA: TPU (Mosaic), GPU (Triton), reference."""
