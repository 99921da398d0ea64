"""TileLang building blocks and the runtime that compiles, caches and launches kernels."""
