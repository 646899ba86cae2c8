"""The pass: every softmax that feeds a product with values is a site; exact matches are
rewritten, the others reported with the idiom that stopped them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, List, Optional

from attn_export.surgery.patterns.emit import emit, erase
from attn_export.surgery.patterns.graph import Constants, NoMatch, site, val
from attn_export.surgery.patterns.scores import reaches
from attn_export.surgery.patterns.match import SOFTMAXES, is_site, match


@dataclass
class PatternSite:
    path: str  # the module whose forward holds the pattern (from the node's nn_module_stack)
    cls: str
    rewritten: bool
    reason: Optional[str] = None
    heads: Optional[int] = None  # of a match, where the graph says them (4-D [B, H, L, D] scores)
    head_dim: Optional[int] = None


def rewrite(exported, needs_grad: Collection[str] = (), *, dry_run: bool = False) -> List[PatternSite]:
    """Rewrites every exact match in ``exported`` (a ``torch.export.ExportedProgram``, changed in
    place). Returns one :class:`PatternSite` per softmax whose result is multiplied by values.

    ``needs_grad``: names of placeholders whose gradients will be wanted (a graph that is run
    for training). A site whose floating bias is computed from one stays as written, since the
    operator treats masks as constants; without it (an export) biases are detached.

    ``dry_run``: nothing is changed; ``rewritten`` then says whether the site would be."""
    from torch._guards import detect_fake_mode

    graph = exported.graph_module.graph
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes if "val" in n.meta])
    constants = Constants(exported)
    sites: List[PatternSite] = []
    for softmax in [n for n in graph.nodes if n.op == "call_function" and n.target in SOFTMAXES]:
        if not is_site(softmax):
            continue  # a softmax that is no attention
        path, cls = site(softmax)
        if val(softmax) is None:
            sites.append(PatternSite(path, cls, False, "no shape information"))
            continue
        try:
            found = match(softmax, constants)
            _grad_free(found, [n for n in graph.nodes if n.op == "placeholder" and n.name in needs_grad])
        except NoMatch as exc:
            sites.append(PatternSite(path, cls, False, str(exc)))
            continue
        heads, head_dim = _geometry(found)
        if not dry_run:
            fused = emit(graph, fake_mode, found)
            found.out.replace_all_uses_with(fused)
            erase(graph, found.erase)
        sites.append(PatternSite(path, cls, True, heads=heads, head_dim=head_dim))
    if any(s.rewritten for s in sites):
        graph.lint()
        exported.graph_module.recompile()
    return sites


def _geometry(found) -> tuple:
    """(heads, head dim) of a match where they are known numbers: the heads from 4-D scores'
    batch [B, H] (3-D [B*H, L, D] scores do not say), the head dim from the query."""
    def known(size):
        return size if isinstance(size, int) else None

    heads = known(found.batch[1]) if len(found.batch) == 2 else None
    q = val(found.scores.q.node)
    perm = found.scores.q.perm
    head_dim = None if q is None else known(q.shape[perm[-1]] if perm else q.shape[-1])
    return heads, head_dim


def _grad_free(found, sources) -> None:
    """NoMatch when a floating term depends on a placeholder that needs gradients."""
    for term in found.chain.biases + ([] if found.scores.bias is None else [found.scores.bias]):
        node = getattr(term, "node", term)
        for source in sources:
            if reaches(node, source, True, limit=1 << 30):  # the whole graph: a miss would drop gradients
                raise NoMatch(f"a bias computed from {source.name}, which needs gradients (the operator "
                              "treats masks as constants)")
