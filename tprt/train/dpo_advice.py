"""DPO's defaults, and the warning that its metrics can hide an unchanged model. Light (no torch):
the CLI's parser and the server's job checks read it.

Defaults (docs/DESIGN.md, "DPO defaults that teach"): beta 0.1 as TRL's and OpenAI's, RPO's
alpha 1.0 where TRL and OpenAI have none, and a LoRA learning rate of 5e-4 for the CLI. Pure DPO maximises the margin between the two answers;
on small sets it does so by pushing both down, so reward accuracy reaches 1.0 while greedy answers
stay the base model's (measured in bench/dpo_bench.py: docs/PERF.md). The preferred answer's NLL
term keeps it likely, and the model then answers in the preferred way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DEFAULT_BETA = 0.1
DEFAULT_RPO_ALPHA = 1.0
# `tprt finetune --objective dpo` with LoRA: at SFT's 2e-4, 60 steps of 4 pairs took 20% of held-out
# answers to the preferred style, at 5e-4 all of them (bench/dpo_bench.py). tprt serve's jobs use
# their own LoRA rate, 1e-3 (serve/jobs/spec.py).
DEFAULT_DPO_LORA_LR = 5e-4
WARN_ACCURACY = 0.9  # a reward accuracy at least this high, with the preferred answers less likely: warn


def unmoved_warning(metrics: Mapping[str, Any]) -> str | None:
    """A warning when DPO's metrics look like success while the preferred answers themselves
    became less likely (their mean reward below 0: log-probability under the reference's): the
    margin grew by pushing both answers down, and greedy answers often stay the base model's.
    Reads the held-out metrics when there are some, else the last step's; None when all is well."""
    prefix = "eval_" if metrics.get("eval_reward_accuracy") is not None else ""
    accuracy, chosen = metrics.get(prefix + "reward_accuracy"), metrics.get(prefix + "rewards_chosen")
    if accuracy is None or chosen is None or not (accuracy >= WARN_ACCURACY and chosen < 0):
        return None
    where = "held-out " if prefix else ""
    return (f"{where}reward accuracy is {accuracy:.2f}, yet the preferred answers became less likely (their reward "
            f"{chosen:+.2f}): DPO widened the margin by pushing both answers down, and greedy answers may not "
            f"change; raise rpo_alpha (the preferred answers' NLL; {DEFAULT_RPO_ALPHA} by default) or lower beta")
