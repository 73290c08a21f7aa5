"""Semantic forks of Ling3: where correct implementations legitimately differ, what a dump's runtime did on each,
and how the JAX reference is configured to follow it (DESIGN §4 `semantics` attr). Torch-free (the replay reads it).

Forks recorded (values are what `parity.torch_ref.semantics.probe` measured on the loaded model):
- `swiglu_clamp`: `applied` | `ignored` | `not-configured` (no limit in the config) | `undetermined` | `mixed`.
  The official remote code and transformers' built-in ignore `expert_swiglu_limit_list` /
  `share_expert_swiglu_limit_list`; the serving stacks apply `min(silu(g), L) ⊙ clip(u, −L, L)` (facts §5.7, §10.1).
  Intended: applied (the serving stacks; omitting it is reported to break Flash, facts §10.1).
- `kda_gate_precision`, `kda_beta_precision`: the dtype of the KDA forget gate (after the gate function) and of β as
  they enter the recurrence: `float32` | `bfloat16` | `float16` | `not-applicable` (no KDA layer). The official file
  keeps both in fp32 (the gate is computed inside the fla kernel, β = σ(b_proj(x).float())); the built-in rounds both
  to the model dtype (official_remote_code.md §5). Intended: float32 (facts §8).
- `kda_chunk_precision`: the dtype the KDA chunk kernel (`chunk_kda`, prompts over 64 tokens) keeps its intermediates
  in: `float32` | `bfloat16` | `float16` | `not-applicable`. fla's chunked Triton kernels store q̂/k̂, the intra-chunk
  A matrices, w/u, the per-chunk states and the new values in the input dtype (the list with file:line is in
  `parity.torch_ref.fla_cpu`): a bf16 run with the real kernels is `bfloat16`; the pure-PyTorch paths and the
  stand-ins compute fp32 unless the stand-ins' faithful mode is chosen (`dump_hf --kda-chunk-precision kernel`).
  Intended: float32 (the maths; a port keeping fp32 intermediates is more precise than the kernel, not wrong).

Config forks recorded alongside (`CONFIG_FORKS`): choices the checkpoint's config.json makes, which the JAX reference
follows from the dump's config, stated so a reader of the dump sees them without opening the config:
- `kda_gate_form`: `lower-bound` (Ling3: g = lb·σ(exp(A_log)·(a + dt_bias)), `kda_lower_bound` = lb) | `softplus`
  (Kimi's form g = −exp(A_log)·softplus(a + dt_bias), `kda_lower_bound: null`) | `not-applicable`; fla picks the form
  by `lower_bound is None` (facts §3.5). The attr's `kda_lower_bound` holds the bound the runtime used.
"""

from __future__ import annotations

from typing import Any

SEMANTICS_VERSION = 1
FORKS = ("swiglu_clamp", "kda_gate_precision", "kda_beta_precision", "kda_chunk_precision")
INTENDED = {"swiglu_clamp": "applied", "kda_gate_precision": "float32", "kda_beta_precision": "float32",
            "kda_chunk_precision": "float32"}
CONFIG_FORKS = ("kda_gate_form",)
# Values that say "this fork does not arise here" (nothing to depart from).
NEUTRAL = {"not-configured", "not-applicable"}
DESCRIPTION = {
    "swiglu_clamp": "SwiGLU clamp min(silu(g),L)·clip(u,±L) of expert_swiglu_limit_list / "
                    "share_expert_swiglu_limit_list (facts §5.7, §10.1)",
    "kda_gate_precision": "dtype of the KDA forget gate entering the recurrence (official_remote_code.md §5)",
    "kda_beta_precision": "dtype of the KDA beta entering the recurrence (official_remote_code.md §5)",
    "kda_chunk_precision": "dtype of the KDA chunk kernel's intermediates (fla's chunk_kda rounds them to the input "
                           "dtype; prompts over 64 tokens)",
}


def departures(sem: dict[str, Any] | None) -> list[dict[str, str]]:
    """Forks where the recorded behaviour departs from the intended one: [{fork, dump, intended, what}]."""
    if not sem:
        return []
    out = []
    for fork in FORKS:
        got = sem.get(fork)
        if got is None or got in NEUTRAL or got == INTENDED[fork]:
            continue
        out.append({"fork": fork, "dump": str(got), "intended": INTENDED[fork], "what": DESCRIPTION[fork]})
    return out


def reference_options(sem: dict[str, Any] | None, *, intended: bool = False) -> dict[str, Any]:
    """Options of the JAX reference (`parity.jax_ling3.spec.layer_spec` / `Ling3Model`) that reproduce a dump's
    semantics (default) or the intended ones (`intended=True`). Unknown / neutral values fall back to intended."""
    src = dict(INTENDED) if intended or not sem else {f: sem.get(f, INTENDED[f]) for f in FORKS}

    def dtype(v: str) -> str:
        return v if v in ("float32", "bfloat16") else "float32"

    return {"clamp": src["swiglu_clamp"] != "ignored",
            "kda_gate_dtype": dtype(src["kda_gate_precision"]),
            "kda_beta_dtype": dtype(src["kda_beta_precision"]),
            "kda_chunk_dtype": dtype(src["kda_chunk_precision"])}


def summarize(sem: dict[str, Any] | None) -> str:
    """One line for reports and the dump CLI."""
    if not sem:
        return "semantics: not recorded (dump written before the semantics attr)"
    parts = [f"{f}={sem.get(f, '?')}" for f in FORKS]
    form = sem.get("kda_gate_form")
    if form is not None:  # dumps written before it was recorded lack it
        lb = sem.get("kda_lower_bound")
        parts.append(f"kda_gate_form={form}" + (f" (lb {lb:g})" if form == "lower-bound" and lb is not None else ""))
    dep = departures(sem)
    tail = f"; departs from intended on {', '.join(d['fork'] for d in dep)}" if dep else ""
    return "semantics: " + ", ".join(parts) + tail


def report_section(sem: dict[str, Any] | None, replayed_with: str, records: list[dict]) -> dict:
    """The report's `semantics` section: what the dump recorded, which behaviour the reference followed
    (`--parity-semantics`), each fork where the dump departs from the intended behaviour, and the points whose
    difference that departure explains (status `semantic`)."""
    # a declared structural difference (parity.targets.taps.coarser) is `semantic` too, but no fork explains it
    explained = [r for r in records if r.get("status") == "semantic" and not r.get("structural")]
    keys = []
    for r in explained:
        lay = "model" if r.get("layer") is None else f"L{r['layer']:02d}"
        # prefill and backward have one step each (no step group, as `Point.key`)
        ph = r["phase"] if r.get("phase") in ("prefill", "backward") else f"decode/S{r.get('step', 0):03d}"
        keys.append(f"{ph}/{lay}/{r['site']}")
    return {"recorded": sem or None, "replayed_with": replayed_with, "departures": departures(sem),
            "explained_points": len(explained), "explained": keys[:200]}


def report_lines(section: dict | None) -> list[str]:
    """Terminal / markdown lines of a report's semantics section (none when the dump departs on no fork)."""
    if not section or not section.get("departures"):
        return []
    out = [f"  SEMANTICS: the dump's runtime departs from the intended behaviour (replayed with the "
           f"{section['replayed_with']} semantics; --parity-semantics dump|intended):"]
    for d in section["departures"]:
        out.append(f"    {d['fork']}: dump {d['dump']}, intended {d['intended']} — {d['what']}")
    if section.get("explained_points"):
        ex = section["explained"]
        out.append(f"    {section['explained_points']} point(s) differ only by that (status semantic), e.g. "
                   + ", ".join(ex[:4]))
    return out


__all__ = ["SEMANTICS_VERSION", "FORKS", "CONFIG_FORKS", "INTENDED", "departures", "reference_options", "summarize",
           "report_section", "report_lines"]
