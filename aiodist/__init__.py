"""aiodist: the tf.distribute programming model on asyncio.

Every replica function is an ``async def`` coroutine; ``merge_call``,
``all_reduce`` and ``all_gather`` are awaitable rendezvous points; reductions run
on NumPy (CPU devices) or CuPy/NCCL (GPU devices). See ``docs/concepts.md``.

This module only re-exports; the implementation lives in private modules.
"""

from ._checkpoint import restore_variables, save_variables
from ._context import (
    experimental_set_strategy,
    get_cross_replica_context,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from ._cross_device_ops import CrossDeviceOps, NcclAllReduce, ReductionToOneDevice
from ._devices import Device, canonical_device
from ._errors import (
    AiodistError,
    CollectiveMismatchError,
    ContextError,
    DeviceError,
    InvalidArgumentError,
    RendezvousError,
    RendezvousTimeoutError,
    ReplicaExitedError,
)
from ._input import DistributedDataset, InputContext, InputOptions, InputReplicationMode
from ._multi_worker import MultiWorkerMirroredStrategy
from ._ops import ReduceOp
from ._options import CommunicationImplementation, CommunicationOptions
from ._replica_context import ReplicaContext
from ._runner import run
from ._stats import RendezvousInFlight, Statistics
from ._strategy import (
    MirroredStrategy,
    OneDeviceStrategy,
    Strategy,
    StrategyExtended,
    ValueContext,
    ready,
)
from ._trace import trace
from ._values import DistributedValues, Mirrored, PerReplica
from ._variables import (
    MirroredVariable,
    SyncOnReadVariable,
    Variable,
    VariableAggregation,
    VariableCopy,
    VariableRef,
    VariableSynchronization,
)

__version__ = "0.1.0"

__all__ = [
    "AiodistError",
    "CollectiveMismatchError",
    "CommunicationImplementation",
    "CommunicationOptions",
    "ContextError",
    "CrossDeviceOps",
    "Device",
    "DeviceError",
    "DistributedDataset",
    "DistributedValues",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "InvalidArgumentError",
    "Mirrored",
    "MirroredStrategy",
    "MirroredVariable",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "PerReplica",
    "ReduceOp",
    "ReductionToOneDevice",
    "RendezvousError",
    "RendezvousInFlight",
    "RendezvousTimeoutError",
    "ReplicaContext",
    "ReplicaExitedError",
    "Statistics",
    "Strategy",
    "StrategyExtended",
    "SyncOnReadVariable",
    "ValueContext",
    "Variable",
    "VariableAggregation",
    "VariableCopy",
    "VariableRef",
    "VariableSynchronization",
    "canonical_device",
    "experimental_set_strategy",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "ready",
    "restore_variables",
    "run",
    "save_variables",
    "trace",
]
