"""Our C kernels for the CPU (AVX2 + OpenMP, built on first use by ``llmkit.core.native``) and their
Python faces: the int8/int4 GEMMs, RMSNorm, pointwise ops, the whole decoder stack in one call, and
weights in transparent huge pages. Each face keeps a torch path for where the C does not build."""
