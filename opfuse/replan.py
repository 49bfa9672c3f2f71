"""Planning again from what a build measured: `replan` (the compile's split-back stage) and its rules.

After the first build, a group whose every config failed the resource check (`TuningResult.over_budget`), a group
of several anchors that measured slower than its ops through PyTorch (`slower_fused`), and, with
`config.split_epilogues`, a group of one anchor whose fastest form ran the anchor apart from its other ops
(`epilogue_apart`) are planned again with those nodes kept apart (`split_back`, `kept_apart`). The model is built
again only where that changes the groups into ones the first build did not time (`splits_that_join`), and the new
build is kept unless its new kernels measure slower than those they replace (`measured_slower`); `replan_note` says
what happened, in words.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from opfuse.api import Analysis
from opfuse.config import FusionConfig
from opfuse.runtime.autotune import TuningResult


def replan(analysis: Analysis, compiled: Any, device: torch.device, examples: Sequence[torch.Tensor],
           config: FusionConfig, quiet: bool, seconds: dict[str, float], say: Callable[[str], None]
           ) -> tuple[Analysis, Any]:
    """(analysis, compiled model) after the split-back stage: as given where the first build (`compiled`) measured
    nothing to split back, or where planning again changes nothing or builds slower kernels; else the plan and
    model built again. `seconds["rebuild"]` gets the second build's time, `compiled.replan_note` what happened."""
    from opfuse.runtime.compiled import build_compiled_model

    tuning = compiled.tuning if compiled.tuning is not None else TuningResult()
    over_budget, apart = dict(tuning.over_budget), dict(tuning.slower_fused)
    if config.split_epilogues:
        apart |= tuning.epilogue_apart
    if not (over_budget or kept_apart(analysis, apart)):     # no kernel spilled or lost to its ops
        return analysis, compiled
    replanned, notes = split_back(analysis, over_budget, apart), []
    if not over_budget and (joining := splits_that_join(analysis, replanned, apart)) != apart:
        # a split that only splits gains nothing the first build did not measure: split only the others
        replanned = split_back(analysis, {}, joining) if kept_apart(analysis, joining) else analysis
        notes.append(f"{len(apart) - len(joining)} of the {len(apart)} groups measured fastest apart only "
                     "split (the first build runs their parts apart already): not built again")
    # and build again where that changed the groups (a one-op group has nothing to split: it keeps the other form
    # the tuner chose for it); kept unless its kernels measure slower than those they replace
    if [g.nodes for g in replanned.plan.groups] != [g.nodes for g in analysis.plan.groups]:
        start = time.perf_counter()
        rebuilt = build_compiled_model(replanned.plan, device, examples, config=config, quiet=quiet)
        seconds["rebuild"] = time.perf_counter() - start
        keep = not measured_slower(rebuilt, compiled)
        notes.insert(0, replan_note(rebuilt, compiled, keep).removeprefix("split back: "))
        if keep:
            analysis, compiled = replanned, rebuilt
    if notes:
        compiled.replan_note = "split back: " + "; ".join(notes)
        say(compiled.replan_note)
    return analysis, compiled


def split_back(analysis: Analysis, over_budget: dict[str, str], slower: dict[str, str] | None = None) -> Analysis:
    """The analysis re-planned so that no kernel brings together again the nodes of a group whose every config
    failed the resource check (`over_budget`: group name -> why), nor the anchors of a group that measured slower
    than its ops through PyTorch (`slower`: group name -> why), nor (with `config.split_epilogues`) the anchor of
    such a group of one anchor with any of its other nodes; the plan's decisions say which and why."""
    from dataclasses import replace as replace_field

    from opfuse.analysis.traffic import summarize_plan
    from opfuse.codegen.lower import groups_through_pytorch
    from opfuse.fusion.planner import plan_fusion

    groups = {g.name: g for g in analysis.plan.groups}
    measured = {frozenset(groups[name].nodes): why for name, why in over_budget.items()}
    plan = plan_fusion(analysis.prepared, analysis.config, analysis.hardware, measured,
                       kept_apart(analysis, slower or {}))
    pytorch_groups = groups_through_pytorch(plan)
    return replace_field(analysis, plan=plan, fused=summarize_plan(plan, analysis.hardware, pytorch_groups),
                         pytorch_groups=pytorch_groups)


def splits_that_join(analysis: Analysis, replanned: Analysis, apart: dict[str, str]) -> dict[str, str]:
    """Of the groups `apart` (name -> why) that `replanned` splits back, those worth building again: a group of
    several anchors (its anchors each fused on their own were never timed), and a group one of whose nodes joins a
    node of another group in `replanned` (a fusion the first build did not time). Not a group of one anchor that
    only splits: the first build runs it in the form the tuner measured fastest, which runs its anchor apart from
    its other ops already (RESULTS.md, run 104: such rebuilds were all slower)."""
    groups = {g.name: g for g in analysis.plan.groups}
    owner = {n: g.name for g in analysis.plan.groups for n in g.nodes}
    joined = set()
    for group in replanned.plan.groups:
        owners = {owner.get(n, n) for n in group.nodes}
        if len(owners) > 1:
            joined |= owners
    return {name: why for name, why in apart.items()
            if name in joined or len(_anchors(analysis.prepared, groups[name].nodes)) > 1}


def changed_seconds(model, than) -> tuple[int, float | None]:
    """(how many, seconds in sum) of the groups of compiled `model` that `than` lacks (groups of other nodes; those
    that launch nothing, views and cats in place, left out), by the autotuner's times of their chosen forms; None
    seconds where one of them has no measured time (untuned, or run through PyTorch without a kernel of opfuse's:
    the tuner times kernels only)."""
    others = {frozenset(g.nodes) for g in than.plan.groups}
    seconds = model.tuning.seconds if model.tuning is not None else {}
    changed = [g.name for g in model.plan.groups if frozenset(g.nodes) not in others and g.launches]
    return len(changed), sum(seconds[name] for name in changed) if all(name in seconds for name in changed) else None


def measured_slower(model, than) -> bool:
    """Whether the kernels of compiled `model` that `than` lacks measured slower in sum than those of `than` it lacks
    (`changed_seconds`); False where either side has no measured time."""
    (_, new), (_, old) = changed_seconds(model, than), changed_seconds(than, model)
    return new is not None and old is not None and new > old


def replan_note(rebuilt, first, kept_new: bool) -> str:
    """What a compile planned again after a split back did, in words: the groups each build has that the other lacks,
    their measured kernel time, and which build it kept (`kept_new`: the rebuilt one, by `measured_slower`)."""
    (count, new), (replaced, old) = changed_seconds(rebuilt, first), changed_seconds(first, rebuilt)
    kept = "kept the new plan" if kept_new else "kept the first build"
    if new is None or old is None:
        return f"split back: {count} groups in place of {replaced}, not all timed; {kept}"
    return (f"split back: {count} groups in place of {replaced}, their kernels {new * 1e6:.1f} us against "
            f"{old * 1e6:.1f} us; {kept}")


def kept_apart(analysis: Analysis, slower: dict[str, str]) -> dict[frozenset[str], str]:
    """The node sets `split_back` keeps apart for the groups whose fastest form ran their anchors apart (group name
    -> why; `TuningResult.slower_fused`, and with `config.split_epilogues` `TuningResult.epilogue_apart`): each pair
    of anchors of a group of several (a horizontal group is merged a sibling at a time); with
    `config.split_epilogues`, the anchor of a group of one with each of its other nodes, and each of those with the
    first anchors after it: split from its own anchor, an op may join a reduction or pointwise kernel (a residual
    add the next layer norm), not another anchor's kernel as a prologue, which only a Triton form can take and
    which it computes again for every tile of output columns (RESULTS.md, run 104: no rebuild with such a
    prologue was kept, in convnext_tiny at batch 1 and 64 and resnet50 at 64)."""
    from itertools import combinations

    graph = analysis.prepared
    groups = {g.name: g for g in analysis.plan.groups}
    users = graph.users()
    apart: dict[frozenset[str], str] = {}
    for name, why in slower.items():
        nodes = groups[name].nodes
        anchors = _anchors(graph, nodes)
        if len(anchors) > 1:
            apart.update({frozenset(pair): why for pair in combinations(anchors, 2)})
        elif len(anchors) == 1 and analysis.config.split_epilogues:
            apart.update({frozenset((anchors[0], n)): why for n in nodes if n != anchors[0]})
            apart.update({frozenset((n, later)): f"{why}, with {anchors[0]} (a prologue of a later anchor is not "
                          "tried)" for n in nodes if n != anchors[0] for later in _anchors_after(graph, n, users)})
    return apart


def _anchors(graph, nodes) -> list[str]:
    """The anchors (convs, GEMMs) among `nodes`, in their order."""
    from opfuse.ir.ops import FusionKind, kind_of

    return [n for n in nodes if kind_of(graph[n]) is FusionKind.ANCHOR]


def _anchors_after(graph, name: str, users) -> set[str]:
    """The anchors that read node `name`'s value, directly or through nodes other than anchors."""
    found, seen, stack = set(), set(), [u.name for u in users.get(name, [])]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if _anchors(graph, [node]):
            found.add(node)
        else:
            stack.extend(u.name for u in users.get(node, []))
    return found
