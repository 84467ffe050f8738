"""Dataflow construction and execution: scopes, streams, operators, capabilities, inputs, probes."""
from .capability import Capability, CapabilityError, InputCapability
from .channels import Broadcast, Distribute, Exchange, Pact, Pipeline
from .dataflow import Dataflow, ProgressMismatchError, ProgressOrderError
from .input import InputError, InputHandle, LoopHandle, ProbeHandle
from .operator import Notificator, OperatorBuilder, OperatorError
from .scope import Captured, OperatorInfo, Scope, Stream

__all__ = [
    "Broadcast", "Capability", "Distribute", "CapabilityError", "Captured", "Dataflow", "Exchange", "InputCapability",
    "InputError", "InputHandle", "LoopHandle", "Notificator", "OperatorBuilder", "OperatorError",
    "OperatorInfo", "Pact", "Pipeline", "ProbeHandle", "ProgressMismatchError", "ProgressOrderError", "Scope", "Stream",
]
