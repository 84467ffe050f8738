"""Dataflow construction and execution: scopes, streams, the operator builder and its handles,
capabilities, pacts, inputs and probes."""
from ..errors import CapabilityError, InputError, OperatorError, ProgressMismatchError, ProgressOrderError
from ..progress.frontier import Frontier
from .builder import OperatorBuilder, OperatorInfo
from .capability import Capability, InputCapability
from .channels import Broadcast, Distribute, Exchange, Pact, Pipeline
from .context import Activator
from .handles import Notificator, OperatorInput, OperatorOutput, Session
from .input import Captured, InputHandle, LoopHandle, ProbeHandle
from .scope import Scope, Stream

__all__ = [
    "Activator", "Broadcast", "Capability", "CapabilityError", "Captured", "Distribute", "Exchange", "Frontier",
    "InputCapability", "InputError", "InputHandle", "LoopHandle", "Notificator", "OperatorBuilder", "OperatorError",
    "OperatorInfo", "OperatorInput", "OperatorOutput", "Pact", "Pipeline", "ProbeHandle", "ProgressMismatchError",
    "ProgressOrderError", "Scope", "Session", "Stream",
]
