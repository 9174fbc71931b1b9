"""Device helpers under the models: CUDA-graph capture and replay, fused Triton kernels."""
