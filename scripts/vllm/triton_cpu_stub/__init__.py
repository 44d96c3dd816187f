"""A stand-in "cpu" backend for triton, so that vLLM's Model Runner V2 starts on a CPU.

triton discovers backends through the ``triton.backends`` entry point and imports
``compiler`` and ``driver`` from the package. Nothing here compiles: every triton
kernel must run in triton's interpreter (``TRITON_INTERPRET=1``).
"""
