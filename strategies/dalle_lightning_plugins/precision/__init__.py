"""The per-resblock precision plugin: its scale rules, the gradient filter at each branch's boundaries, their fused kernels."""
