"""Driver half of the stand-in backend: reports one always-active CPU "device"."""

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


class CpuStubDriver(DriverBase):
    def __init__(self):
        pass

    @classmethod
    def is_active(cls):
        return True

    def get_current_target(self):
        return GPUTarget("cpu", "x86_64", 1)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        return None

    def get_current_stream(self, device=None):
        return 0

    def map_python_to_cpp_type(self, ty):
        return ty

    def get_benchmarker(self):
        from triton.testing import do_bench

        return do_bench
