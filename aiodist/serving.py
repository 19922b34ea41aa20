"""aiodist.serving: distributed inference inside async servers (framework-neutral).

See ``docs/serving.md``. This module only re-exports.
"""

from ._batcher import Batcher, BatcherStats, NotServing, Overloaded

__all__ = ["Batcher", "BatcherStats", "NotServing", "Overloaded"]
