"""RL algorithm pieces: registries of pure tensor functions with one signature per family.

Callers look a piece up by the name a config gives and call it, never branching
on the name:

    ADVANTAGES.get(name)(AdvantageInput, AdvantageConfig) -> AdvantageOutput
    POLICY_LOSSES.get(name)(PolicyLossInput, PolicyLossConfig) -> PolicyLossOutput
    KL_ESTIMATORS.get(name)(logp, ref_logp) -> [N, T]
    KL_MODES.get(name)(logp, ref_logp, mask, beta, estimator) -> [N, T]
    OFFPOLICY_CORRECTIONS.get(name)(CorrectionInput, CorrectionConfig) -> CorrectionOutput
    AGGREGATIONS.get(name)(loss, mask, AggregationNorm) -> scalar
    PREFERENCE_LOSSES.get(name)(PreferenceInput, PreferenceConfig) -> PreferenceOutput

Importing this package registers every built-in entry.
"""

from tandem.rl.algorithms.advantages import (
    ADVANTAGES,
    AdvantageConfig,
    AdvantageInput,
    AdvantageOutput,
    dense_group_index,
)
from tandem.rl.algorithms.aggregation import (
    AGGREGATIONS,
    AggregationNorm,
    aggregate,
    entropy_loss,
    make_norm,
)
from tandem.rl.algorithms.distill import (
    chunk_opd_advantages,
    chunk_reverse_kl,
    chunk_sums,
    opd_advantages,
    reverse_kl_full,
    reverse_kl_sampled,
)
from tandem.rl.algorithms.filters import filter_groups, overlong_filter_mask, overlong_penalty
from tandem.rl.algorithms.kl import KL_ESTIMATORS, KL_MODES, kl_loss_term, kl_penalty_rewards
from tandem.rl.algorithms.offpolicy import (
    OFFPOLICY_CORRECTIONS,
    CorrectionConfig,
    CorrectionInput,
    CorrectionOutput,
    m2po_keep,
    proximal_logp,
)
from tandem.rl.algorithms.policy_loss import (
    POLICY_LOSSES,
    PolicyLossConfig,
    PolicyLossInput,
    PolicyLossOutput,
)
from tandem.rl.algorithms.preference import (
    PREFERENCE_LOSSES,
    PreferenceConfig,
    PreferenceInput,
    PreferenceOutput,
    bradley_terry_loss,
)
from tandem.rl.algorithms.value import value_loss

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "KL_MODES",
    "OFFPOLICY_CORRECTIONS",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "AdvantageConfig",
    "AdvantageInput",
    "AdvantageOutput",
    "AggregationNorm",
    "CorrectionConfig",
    "CorrectionInput",
    "CorrectionOutput",
    "PolicyLossConfig",
    "PolicyLossInput",
    "PolicyLossOutput",
    "PreferenceConfig",
    "PreferenceInput",
    "PreferenceOutput",
    "aggregate",
    "bradley_terry_loss",
    "chunk_opd_advantages",
    "chunk_reverse_kl",
    "chunk_sums",
    "dense_group_index",
    "entropy_loss",
    "filter_groups",
    "kl_loss_term",
    "kl_penalty_rewards",
    "m2po_keep",
    "make_norm",
    "opd_advantages",
    "overlong_filter_mask",
    "overlong_penalty",
    "proximal_logp",
    "reverse_kl_full",
    "reverse_kl_sampled",
    "value_loss",
]
