"""The RL update's bookkeeping: named sums, learners as a list, "needs the old log-probs" as a
capability, checked on small hand-made cases against what each should do."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from tandem.rl.config.schema import FaultConfig
from tandem.rl.core.optim import Learner, build_scheduler
from tandem.rl.recipes.base import Updater
from tandem.rl.update.loss import UpdateSums
from tandem.rl.update.phase import UpdatePhase


def test_update_sums_add_by_name_in_float64():
    s = UpdateSums.zeros(torch.device("cpu"))
    names = (
        "clipped",
        "entropy",
        "kl",
        "tokens",
        "is_weight",
        "is_weight_sq",
        "dropped",
        "kl_behav",
        "kl_prox",
    )
    s.add_loss(torch.tensor(0.5), {k: torch.tensor(float(i + 2)) for i, k in enumerate(names)})
    part = UpdateSums.zeros(torch.device("cpu"))
    part.add_value(torch.tensor(1.5), 4)
    s += part
    s.steps = s.steps + 1
    assert s.flat().dtype == torch.float64
    assert s.flat().tolist() == [0.5, 2.0, 3.0, 4.0, 5.0, 1.0, 1.5, 4.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    named = (
        s.loss.item(),
        s.tokens.item(),
        s.value_sq_err.item(),
        s.value_tokens.item(),
        s.kl_prox.item(),
    )
    assert named == (0.5, 5.0, 1.5, 4.0, 10.0)


def _learner(name, lr=0.1, schedule=True):
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sched = None
    if schedule:
        sched = build_scheduler(
            opt, total_steps=10, warmup_steps=4, decay="constant", min_lr_ratio=0.0
        )

    def clip(max_norm):
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))

    return model, Learner(name, [model], opt, clip, 1.0, sched)


def _grads(*models):
    for m in models:
        m(torch.ones(1, 3)).sum().backward()


def test_updater_steps_the_chosen_learners_and_drops_everyones_gradients_on_nan(tmp_path):
    policy, lp = _learner("policy")
    critic, lc = _learner("critic", schedule=False)
    up = Updater(
        [lp, lc], fault=FaultConfig(on_nonfinite="skip"), dump_folder=str(tmp_path), rank=0
    )
    w_policy, w_critic = policy.weight.detach().clone(), critic.weight.detach().clone()

    _grads(policy, critic)  # a critic warm-up update: only the critic steps, the policy waits
    norms = up.apply(torch.tensor(1.0), 0, [lc])
    assert set(norms) == {"critic"} and torch.equal(policy.weight, w_policy)
    assert not torch.equal(critic.weight, w_critic)
    assert lp.scheduler.last_epoch == 0 and policy.weight.grad is None  # every gradient zeroed
    assert up.last_lr == pytest.approx(0.1 * 1 / 4)  # the warm-up's first factor, unchanged

    _grads(policy, critic)
    with torch.no_grad():
        critic.weight.grad[0, 0] = float("nan")  # a NaN in the critic skips the whole update
    w_policy, w_critic = policy.weight.detach().clone(), critic.weight.detach().clone()
    assert up.apply(torch.tensor(1.0), 1) == {}
    assert up.skipped == 1
    assert torch.equal(policy.weight, w_policy) and torch.equal(critic.weight, w_critic)
    assert policy.weight.grad is None and critic.weight.grad is None
    assert lp.scheduler.last_epoch == 1  # a skipped update still advances the schedule

    _grads(policy, critic)
    norms = up.apply(torch.tensor(1.0), 2)
    assert set(norms) == {"policy", "critic"} and not torch.equal(policy.weight, w_policy)


def _phase(
    *,
    epochs=1,
    minibatches=1,
    kl_mode="loss",
    ref=False,
    trainers=(),
    teachers=None,
    correction="tis",
    proximal="recompute",
):
    rl = SimpleNamespace(
        epochs=epochs,
        minibatches=minibatches,
        kl_mode=kl_mode,
        offpolicy_correction=correction,
        proximal=proximal,
    )
    trainers = [SimpleNamespace(needs_old_logp=False), *trainers]
    return UpdatePhase(
        rl=rl,
        max_tokens=8,
        distill=None,
        policy=None,
        ref=object() if ref else None,
        trainers=trainers,
        updater=None,
        teachers=teachers,
        dp=(1, None),
        device=torch.device("cpu"),
        samples_to_log=0,
        chunk_tokens=1024,
    )


def test_the_old_log_probs_get_a_forward_only_when_something_needs_them():
    assert not _phase().needs_old_logp  # one optimizer step: the training forward's own log-probs
    assert not _phase(ref=True, kl_mode="loss").needs_old_logp  # a KL loss term: current ones
    assert _phase(ref=True, kl_mode="reward").needs_old_logp  # KL_MODES["reward"] declares it
    assert not _phase(ref=False, kl_mode="reward").needs_old_logp  # no reference: no KL at all
    assert _phase(epochs=2).needs_old_logp  # the policy moves between optimizer steps
    assert _phase(minibatches=3).needs_old_logp
    critic = SimpleNamespace(needs_old_logp=True)
    assert _phase(trainers=[critic]).needs_old_logp  # a critic says so
    assert _phase(teachers=SimpleNamespace(needs_old_logp=True)).needs_old_logp  # OPD reads them
    assert _phase(correction="m2po").needs_old_logp  # its token cut is taken over the whole step
    # AReaL's log-linear proximal policy needs no forward, even for several optimizer steps
    assert not _phase(epochs=2, correction="decoupled", proximal="loglinear").needs_old_logp
    assert _phase(epochs=2, correction="decoupled", proximal="recompute").needs_old_logp
    # tis always divides by the recomputed proximal policy
    assert _phase(epochs=2, correction="tis", proximal="loglinear").needs_old_logp
