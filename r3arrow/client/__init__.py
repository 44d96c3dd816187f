"""Async engine client for vLLM's and SGLang's generate APIs, with incremental route capture
into a `RouteTrace`, retries (`RetryPolicy`), size caps and sticky routing of a session to
one base URL (``docs/design.md``, "Wire formats"; ``docs/sglang.md``).
"""

from r3arrow._extras import require

with require(extra="client", feature="r3arrow.client"):
    import httpx  # noqa: F401 - the extra's message before the modules below need it

from r3arrow._public import set_homes
from r3arrow.client._client import EngineClient, GenerateOutput, Protocol
from r3arrow.client._protocol import Endpoint
from r3arrow.client._retry import RetryPolicy

__all__ = ["Endpoint", "EngineClient", "GenerateOutput", "Protocol", "RetryPolicy"]

set_homes(globals(), __all__)
