"""The matmul-precision policy of a replay and the dot-precision diagnosis of a report (issue 31); pure, no replay
imports (the session applies the policy, `parity.replay.dot_precision` holds the shadow that finds the diagnosis).

A target's fp32 dots written without `precision=` run at JAX's default matmul precision, which on TPU is one bf16
pass (operands rounded to bf16, fp32 accumulation) and on GPU may be TF32; the dumps' fp32 matmuls ran as IEEE fp32
(torch's default; the dumper forces it, the dump's `kernels.fp32_matmul`). So the replay runs every target call
under `jax.default_matmul_precision(P)`, P = "highest" by default (`--parity-matmul-precision default|high|highest`
chooses; "default" enters no context: JAX's own setting stays in force), and records P in the report
(`replay_env.matmul_precision`). XLA:CPU ignores the setting (its fp32 dots are IEEE whatever it says: jax 0.10.2, an
fp32 einsum under 'bfloat16' gave the same bits as under 'highest'), so on CPU the policy changes nothing but a target
that reads it (the planted `parity.targets.mutants.PlantedTpuDefaultPrecision` does, as a TPU would).
"""

from __future__ import annotations

POLICIES = ("default", "high", "highest")
DEFAULT_POLICY = "highest"
FIX = ("run the port's fp32 dots at full precision: `with jax.default_matmul_precision('highest'):` around it, "
       "precision=jax.lax.Precision.HIGHEST on its dots, or `--parity-matmul-precision highest` (the default)")
WHAT = "the target's fp32 dots run one bf16 pass (TPU's DEFAULT matmul precision)"


def resolve_policy(option: str | None) -> dict:
    """The policy a replay applies: `option` as `--parity-matmul-precision` gives it (None: the default), with
    where it came from. "default" means: JAX's own setting (no context entered)."""
    if option is None:
        return {"policy": DEFAULT_POLICY, "source": "default (the dumps' fp32 matmuls are IEEE fp32)"}
    if option not in POLICIES:
        from parity.errors import ParityError

        raise ParityError(f"--parity-matmul-precision {option!r}: expected one of {', '.join(POLICIES)}")
    return {"policy": option, "source": "--parity-matmul-precision"}


def under_policy(policy: str | None, fn):
    """`fn` wrapped so that it runs under `jax.default_matmul_precision(policy)` in the thread that calls it (the
    watchdog runs target calls in its own thread, and JAX's context is thread-local); "default" / None: as is."""
    if policy in (None, "default"):
        return fn

    def wrapped(*args, **kwargs):
        import jax

        with jax.default_matmul_precision(policy):
            return fn(*args, **kwargs)

    return wrapped


# ------------------------------------------------------------------------------------------------ the diagnosis
def summary(points: list[dict]) -> dict | None:
    """The report's `dot_precision` section from its point dicts (in execution order): how many failing points the
    shadow explains, the first of them, whether it explains the first failing point (`explains_first`), and the
    diagnosis with the fix — named only where it explains the first failing point and every failing point it was
    compared with (a precision bug's downstream points can match it by chance: measured, the planted `norm_stats_bf16`
    on tiny-bf16 layers 0-1 had 6 of 66 failing points within the bf16 rules of the shadow, not the first). None when no failing
    point was compared with the shadow."""
    fails = [r for r in points if r.get("status") == "fail"]
    seen = [r for r in fails if "dot_precision" in r]
    if not seen:
        return None
    match = [r for r in seen if r["dot_precision"].get("matches")]
    first = match[0] if match else None
    explains_first = bool(match) and match[0] is fails[0]
    named = explains_first and len(match) == len(seen)
    return {"failing": len(fails), "compared": len(seen), "explained": len(match), "explains_first": explains_first,
            "first": None if first is None else {k: first.get(k) for k in ("phase", "step", "layer", "site")},
            "diagnosis": WHAT if named else None, "fix": FIX if named else None}


__all__ = ["DEFAULT_POLICY", "FIX", "POLICIES", "WHAT", "resolve_policy", "summary", "under_policy"]
