"""Compiler half of the stand-in backend: accepts the "cpu" target, refuses to compile."""

from triton.backends.compiler import BaseBackend

_NO_COMPILE = "triton_cpu_stub cannot compile kernels: run with TRITON_INTERPRET=1"


class CpuStubBackend(BaseBackend):
    @staticmethod
    def supports_target(target):
        return getattr(target, "backend", None) == "cpu"

    def hash(self):
        return "triton-cpu-stub"

    def parse_options(self, options):
        raise RuntimeError(_NO_COMPILE)

    def add_stages(self, stages, options, language):
        raise RuntimeError(_NO_COMPILE)

    def load_dialects(self, context):
        return None

    def get_module_map(self):
        return {}
