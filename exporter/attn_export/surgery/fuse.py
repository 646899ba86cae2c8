"""Hand-written attention fused in PyTorch: the graph ``torch.export`` captures, rewritten by
:mod:`attn_export.surgery.patterns`, run as a module (``fuse_patterns``) or as the compiled code
of ``torch.compile(model, backend="attn_export")``. Importing this module (``attn_export.fuse_patterns``
and ``attn_export.compile_backend`` do) registers the name; ``backend=attn_export.compile_backend``
needs no registration.

The dynamo backend receives a torch-level FX graph (torch functions and Tensor methods); the
rewrite reads ATen. On the compiled code's first call the backend exports that graph
(``torch.export``, non-strict) with the real inputs, the sizes dynamo traced symbolically marked
dynamic (dynamo passes them as separate inputs; they are read off the tensors that carry them),
and from then on runs the rewritten program's module. A graph it cannot export runs as dynamo
captured it. With gradients on, sites whose bias is computed from a tensor that requires grad
stay as written (the operator treats masks as constants), and so does dropout in training mode."""
from __future__ import annotations

import logging
import re
from typing import Any, Dict, List, Optional, Sequence

import torch

from attn_export.surgery.patterns import PatternSite, rewrite

BACKEND_NAME = "attn_export"
log = logging.getLogger(__name__)


def _needs_grad(exported, user_values: Sequence[Any]) -> List[str]:
    """Placeholders whose gradients a training run would want: parameters that require grad and
    user inputs that do (dynamo passes a model's parameters as inputs)."""
    if not torch.is_grad_enabled():
        return []
    sig = exported.graph_signature
    names = [name for name, target in sig.inputs_to_parameters.items()
             if exported.state_dict[target].requires_grad]
    names += [name for name, value in zip(sig.user_inputs, user_values)
              if isinstance(value, torch.Tensor) and value.requires_grad]
    return names


def fuse_patterns(model: torch.nn.Module, args: tuple, kwargs: Optional[Dict[str, Any]] = None, *,
                  dynamic_shapes=None, for_training: bool = False) -> torch.nn.Module:
    """``model`` exported with ``args``/``kwargs`` and its hand-written attention rewritten to
    ``attn_export::attention``: the program's module (``ExportedProgram.module()``), which takes
    the same inputs (shapes as ``dynamic_shapes`` allows) and holds the per-site report as
    ``pattern_sites`` (:class:`PatternSite` rows).

    ``for_training``: sites whose bias is computed from something that requires grad stay as
    written (the operator treats masks as constants); by default such biases are detached."""
    exported = torch.export.export(model, tuple(args), kwargs or {}, dynamic_shapes=dynamic_shapes, strict=False)
    needs_grad = []
    if for_training:
        sig = exported.graph_signature
        needs_grad = [n for n, t in sig.inputs_to_parameters.items() if exported.state_dict[t].requires_grad]
    sites = rewrite(exported, needs_grad)
    module = exported.module()
    module.pattern_sites = sites
    return module


class _TensorsOnly(torch.nn.Module):
    """A captured graph called with its tensors only: the sizes dynamo passes as separate inputs
    (a graph traced with dynamic shapes) are read off the tensors that carry them, so that
    ``torch.export`` sees those sizes as the tensors' own dynamic dimensions."""

    def __init__(self, gm, sources):
        super().__init__()
        self.gm, self.sources = gm, sources  # per placeholder: ("tensor", k) or ("size", k, dim)

    def forward(self, *tensors):
        args = [tensors[s[1]] if s[0] == "tensor" else tensors[s[1]].size(s[2]) for s in self.sources]
        return self.gm(*args)


def _sources(gm: torch.fx.GraphModule):
    """For each placeholder, where its value comes from among the tensor inputs; None when an
    input is neither a tensor nor one of their sizes."""
    fakes = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    tensor_index, carriers = {}, {}
    for i, fake in enumerate(fakes):
        if isinstance(fake, torch.Tensor):
            tensor_index[i] = len(tensor_index)
            for d, size in enumerate(fake.shape):
                if isinstance(size, torch.SymInt):
                    carriers.setdefault(str(size.node.expr), (tensor_index[i], d))
    sources = []
    for i, fake in enumerate(fakes):
        if i in tensor_index:
            sources.append(("tensor", tensor_index[i]))
        elif isinstance(fake, torch.SymInt) and str(fake.node.expr) in carriers:
            sources.append(("size",) + carriers[str(fake.node.expr)])
        else:
            return None, None
    dynamic = [{d: torch.export.Dim.AUTO for d, size in enumerate(fakes[i].shape) if isinstance(size, torch.SymInt)}
               or None for i in tensor_index]
    return sources, dynamic


class Backend:
    """``torch.compile`` backend: export, rewrite, run the program's module. ``sites`` keeps the
    report of every graph it compiled (one list per graph)."""

    def __init__(self):
        self.sites: List[List[PatternSite]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        sources, dynamic = _sources(gm)
        if sources is None:
            log.warning("attn_export backend: a graph with inputs other than tensors and their sizes runs as captured")
            return gm.forward
        return _Compiled(self, gm, sources, dynamic)


class _Compiled:
    """The compiled code of one graph. It is exported on its first call, with the real inputs:
    exporting inside dynamo's compilation would mix export's tracing into dynamo's (its guards
    and fake tensors)."""

    def __init__(self, owner: Backend, gm, sources, dynamic):
        self.owner, self.gm, self.sources, self.dynamic = owner, gm, sources, dynamic
        self.positions = [i for i, s in enumerate(sources) if s[0] == "tensor"]
        self.module = None
        self.grad_enabled = torch.is_grad_enabled()  # dynamo guards on it: one graph, one mode

    def __call__(self, *args):
        tensors = tuple(args[i] for i in self.positions)
        if self.module is None:
            self.module = self._export(tensors)
        return self.module(*tensors) if self.module is not self.gm else self.gm(*args)

    def _export(self, tensors):
        try:
            exported = torch.export.export(_TensorsOnly(self.gm, self.sources), tensors, strict=False,
                                           dynamic_shapes=(tuple(self.dynamic),) if any(self.dynamic) else None)
        except Exception as exc:  # noqa: BLE001 - the captured graph still runs as it is
            log.warning("attn_export backend: torch.export failed (%s); the graph runs as captured",
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            self.owner.sites.append([])
            return self.gm
        with torch.set_grad_enabled(self.grad_enabled):
            needs_grad = _needs_grad(exported, tensors)
        self.owner.sites.append([self._named(site) for site in rewrite(exported, needs_grad)])
        return exported.module()

    def _named(self, site: PatternSite) -> PatternSite:
        """Reasons name dynamo's inputs (``l_self_parameters_bias_``), not the wrapper's ``tensors_3``."""
        if site.reason:
            names = [n.name for n in self.gm.graph.nodes if n.op == "placeholder"]
            site.reason = re.sub(r"\btensors_(\d+)\b", lambda mt: names[self.positions[int(mt.group(1))]],
                                 site.reason)
        return site


backend = Backend()


def _register() -> None:
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if BACKEND_NAME not in _COMPILER_FNS:
        register_backend(backend, name=BACKEND_NAME)


_register()
