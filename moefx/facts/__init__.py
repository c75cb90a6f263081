"""What a model and a machine are: the signatures' facts, read from configs, weights and this host.

The bottom of the planning layers: everything here imports only moefx's foundation (config, machine, log), so
backends, offload, parallel and passes read these facts, and the planner (`moefx.planner`) decides from them.
"""

from moefx.facts.execution import ExecutionSignature
from moefx.facts.model import ModelSignature

__all__ = ["ExecutionSignature", "ModelSignature"]
