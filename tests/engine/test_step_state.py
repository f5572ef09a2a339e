"""The step's state machine (engine/step_state.py, [Note: step phases]): every legal move, every
illegal one refused by both names, and the phases real engine steps go through, in order."""
from __future__ import annotations

import copy

import pytest
import torch

import tiered
from tiered.core.errors import TieredError
from tiered.engine.step_state import LEGAL, Phase, PhaseError, StepState, UpdatePhase
from tiered.optim.arrival import LastBackward
from tiered.optim.commands import UpdateMode

from gpt import next_token_loss
from helpers_models import (OPTIM, SEQ, VOCAB, CheckpointedGPT, assert_parity, batch, fp32_engine,
                            make_gpt, make_model, reference_optimizer)

P = Phase
LAST_BACKWARD = LastBackward(step_units=False, forward_rank={}, hypers=None)


def the_last_backward() -> LastBackward:
    """What the runtime says of a step's last backward (runtime._last_backward)."""
    return LAST_BACKWARD


def in_backward(action) -> None:
    """Run ``action`` inside an autograd pass (a tensor hook), as the engine's hooks run."""
    def hook(grad):
        action()

    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(hook)
    y.sum().backward()


def watched(state: StepState) -> list[Phase]:
    """The phases ``state`` moves to, from now on."""
    seen: list[Phase] = []
    state.watch(lambda before, after: seen.append(after))
    return seen


@pytest.mark.parametrize("before,after", [(before, after) for before, nexts in LEGAL.items()
                                          for after in sorted(nexts, key=lambda p: p.value)])
def test_every_legal_move_is_taken(before, after):
    state = StepState(accumulation_steps=None, loss_scaled=False)
    state.phase = before
    seen = watched(state)
    state._move(after)
    assert state.phase is after and seen == [after]


@pytest.mark.parametrize("before,after", [(before, after) for before in Phase for after in Phase
                                          if after not in LEGAL[before]])
def test_every_illegal_move_is_refused_by_both_names(before, after):
    state = StepState(accumulation_steps=None, loss_scaled=False)
    state.phase = before
    with pytest.raises(PhaseError, match=f"from {before.value} to {after.value}"):
        state._move(after)
    assert state.phase is before


def test_every_phase_is_reachable_and_can_go_on():
    assert set(LEGAL) == set(Phase)
    assert set().union(*LEGAL.values()) == set(Phase)
    assert all(LEGAL[phase] for phase in Phase)


def test_forwards_nest_and_end_in_the_phase_their_output_allows():
    state = StepState(accumulation_steps=None, loss_scaled=False)
    seen = watched(state)
    assert state.start_forward() and not state.start_forward()  # the model calls itself
    assert not state.end_forward(backward_may_follow=True) and state.phase is P.FORWARD
    assert state.end_forward(backward_may_follow=True)
    state.start_forward()  # a forward without backward: another forward follows
    state.end_forward(backward_may_follow=False)  # its output cannot start a backward
    with torch.no_grad():
        state.start_forward()
        state.end_forward(backward_may_follow=True)
    state.start_forward()
    state.abandon_forward()  # a KeyboardInterrupt past torch's always_call hooks
    assert state.forward_depth == 0
    assert seen == [P.FORWARD, P.AWAITING_BACKWARD, P.FORWARD, P.IDLE, P.NO_GRAD_FORWARD,
                    P.IDLE, P.FORWARD, P.IDLE]


def test_a_backward_counts_once_recomputes_and_ends_at_autograds_end():
    state = StepState(accumulation_steps=2, loss_scaled=False)
    state.start_forward()
    state.end_forward(backward_may_follow=True)
    seen = watched(state)

    def backward():
        state.enter_backward()
        state.enter_backward()  # later hooks of the pass
        state.start_recompute()
        state.start_recompute()  # a nested unit's forward
        state.end_recompute()
        assert state.phase is P.RECOMPUTE and not state.counted
        state.end_recompute()
        state.count_backward(the_last_backward)
        state.start_recompute()
        assert state.counted
        state.end_recompute()

    in_backward(backward)
    assert seen == [P.BACKWARD, P.RECOMPUTE, P.BACKWARD, P.BACKWARD_COUNTED, P.RECOMPUTE,
                    P.BACKWARD_COUNTED, P.IDLE]
    assert state.backwards == 1 and state.last_backward is None
    in_backward(lambda: (state.enter_backward(), state.count_backward(the_last_backward)))  # IDLE -> BACKWARD
    assert state.backwards == 2 and state.last_backward is LAST_BACKWARD  # accumulation_steps' last
    with pytest.raises(TieredError, match="backward number 3 .*accumulation_steps is 2:"):
        in_backward(lambda: (state.enter_backward(), state.count_backward(the_last_backward)))
    state.start_step()  # that backward raised: the step ends it first
    state.step_taken()
    state.end_step()
    assert state.backwards == 0 and state.last_backward is None
    assert seen[-4:] == [P.BACKWARD, P.IDLE, P.STEPPING, P.IDLE]


def test_a_hook_outside_autograd_moves_nothing():
    state = StepState(accumulation_steps=None, loss_scaled=False)
    state.enter_backward()
    assert state.phase is P.IDLE


def test_a_backward_inside_the_models_forward_is_refused_by_name():
    state = StepState(accumulation_steps=None, loss_scaled=False)
    state.start_forward()
    with pytest.raises(PhaseError, match="from forward to backward"):
        in_backward(state.enter_backward)


def test_fp16_counts_only_a_scaled_backward_and_keeps_the_gradients_scale():
    state = StepState(accumulation_steps=None, loss_scaled=True)
    with pytest.raises(TieredError, match=r"engine\.backward\(loss\)"):
        in_backward(lambda: (state.enter_backward(), state.count_backward(the_last_backward)))
    state.recover()  # the refused backward never reached autograd's end
    assert state.phase is P.IDLE and state.backwards == 0
    state.loss_scale_noted(2.0**16)
    in_backward(lambda: (state.enter_backward(), state.count_backward(the_last_backward)))
    assert state.phase is P.IDLE and state.backwards == 1
    state.loss_scale_noted(2.0**15)  # the scaler backed off between two backwards of a step
    state.scaled_backward_over()  # that backward reached no unit: its word does not carry over
    with pytest.raises(TieredError, match=r"engine\.backward\(loss\)"):
        in_backward(lambda: (state.enter_backward(), state.count_backward(the_last_backward)))
    assert state.grads_loss_scale == 2.0**16  # the scale the held gradients were made with
    state.gradients_dropped()
    assert state.grads_loss_scale is None


def test_an_update_is_sent_only_once_the_last_one_finished():
    state = StepState(accumulation_steps=None, loss_scaled=True)

    class Update:
        mode = UpdateMode.DELAYED

    state.update_sent(Update())
    assert state.update_phase is UpdatePhase.DELAYED
    with pytest.raises(PhaseError, match="while the one before it is delayed"):
        state.update_sent(Update())
    state.update_finished(skipped=True)
    assert state.update_phase is UpdatePhase.NONE and state.last_update_skipped
    state.update_restored(None)
    assert not state.last_update_skipped


# -- real engine steps ----------------------------------------------------------------------------

def test_engine_steps_go_through_the_phases_in_order():
    """A step, a no-grad forward, a forward without backward, and the step after it; the
    engine still trains as PyTorch does, to the bit."""
    model = make_gpt(qkv_bias=False)
    reference = copy.deepcopy(model)
    engine, optimizer = fp32_engine(model)
    ref_optimizer = reference_optimizer(reference)
    seen = watched(engine.runtime.step_state)
    for step, seed in enumerate((0, 1)):
        idx = batch(seed)
        for m, o in ((engine, optimizer), (reference, ref_optimizer)):
            next_token_loss(m(idx), idx).backward()
            with torch.no_grad():
                m(batch(10))
            m(batch(20))  # grad enabled, its backward never comes
            o.step()
            o.zero_grad()
        assert seen == [P.FORWARD, P.AWAITING_BACKWARD, P.BACKWARD, P.BACKWARD_COUNTED, P.IDLE,
                        P.NO_GRAD_FORWARD, P.IDLE, P.FORWARD, P.AWAITING_BACKWARD,
                        P.STEPPING, P.IDLE], step
        seen.clear()
    assert_parity(engine.full_state_dict(), reference.state_dict())
    engine.close()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_recomputes_inside_the_backward(use_reentrant, monkeypatch):
    monkeypatch.setattr(CheckpointedGPT, "use_reentrant", use_reentrant)
    torch.manual_seed(0)
    model = CheckpointedGPT(VOCAB, 32, 3, 2, max_seq=SEQ, tied=True, qkv_bias=False)
    engine, optimizer = fp32_engine(model)
    seen = watched(engine.runtime.step_state)
    idx = batch(0)
    next_token_loss(engine(idx), idx).backward()
    optimizer.step()
    # The root's weights are read first (the head), then each block, last first, runs its
    # forward again before its backward; the last block's gradient is the pass's first.
    assert seen == [P.FORWARD, P.AWAITING_BACKWARD,
                    P.BACKWARD, P.RECOMPUTE, P.BACKWARD, P.BACKWARD_COUNTED,
                    P.RECOMPUTE, P.BACKWARD_COUNTED, P.RECOMPUTE, P.BACKWARD_COUNTED,
                    P.IDLE, P.STEPPING, P.IDLE]
    engine.close()


def test_accumulated_backwards_count_towards_the_declared_last():
    engine, optimizer = tiered.initialize(make_model(), "configs/cpu.yaml", compute_dtype="fp32",
                                          device="cpu",
                                          optimizer=dict(OPTIM, accumulation_steps=2))
    state = engine.runtime.step_state
    for micro in range(2):
        idx = batch(micro)
        next_token_loss(engine(idx), idx).backward()
        assert state.backwards == micro + 1 and state.phase is P.IDLE
        assert (state.last_backward is not None) == (micro == 1)
    optimizer.step()
    assert state.backwards == 0 and state.last_backward is None
    engine.close()


@pytest.mark.parametrize("delayed", [False, True])
def test_an_overflowed_fp16_update_is_skipped(delayed):
    engine, optimizer = tiered.initialize(
        make_model(), "configs/cpu.yaml", compute_dtype="fp16", device="cpu",
        loss_scale={"initial_scale": 2.0**40},
        optimizer=dict(OPTIM, delayed_update={"enabled": delayed, "warmup_steps": 0}))
    state = engine.runtime.step_state
    idx = batch(0)
    engine.backward(next_token_loss(engine(idx), idx))  # 2**40 overflows fp16 gradients
    assert state.grads_loss_scale == 2.0**40
    optimizer.step()
    # The delayed update overlaps the next forward and backward; fp16's ordinary one blocks
    # (its next backward needs the scale it decides).
    assert state.update_phase is (UpdatePhase.DELAYED if delayed else UpdatePhase.NONE)
    assert optimizer.step_was_skipped is not delayed
    optimizer.synchronize()
    assert state.update_phase is UpdatePhase.NONE
    assert optimizer.step_was_skipped and optimizer.skipped_steps == 1
    assert state.grads_loss_scale is None and engine.scaler.scale == 2.0**39
    engine.close()


def test_an_ordinary_update_runs_beside_the_next_forward():
    engine, optimizer = fp32_engine(make_gpt())
    state = engine.runtime.step_state
    idx = batch(0)
    next_token_loss(engine(idx), idx).backward()
    optimizer.step()
    assert state.update_phase is UpdatePhase.RUNNING  # overlapped: readers wait per unit
    optimizer.synchronize()
    assert state.update_phase is UpdatePhase.NONE and not optimizer.step_was_skipped
    engine.close()
