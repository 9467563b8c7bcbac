"""Training steps whose losses and gradients the offloading tests compare with and without offload."""

import torch


def losses_and_gradients(model, steps, step_loss):
    """`steps` backward passes of `step_loss(model, step)`: ([loss per step], [{parameter name: gradient} per
    step])."""
    losses, grads = [], []
    for step in range(steps):
        model.zero_grad()
        loss = step_loss(model, step)
        loss.backward()
        losses.append(loss.item())
        grads.append({name: param.grad.clone() for name, param in model.named_parameters()})
    return losses, grads


def assert_same_training(plain, offloaded):
    """`losses_and_gradients` of a run with offload equal, to the last bit, those of the run without."""
    (plain_losses, plain_grads), (losses, grads) = plain, offloaded
    assert losses == plain_losses
    for plain_step, step in zip(plain_grads, grads, strict=True):
        assert plain_step.keys() == step.keys()
        for name in plain_step:
            assert torch.equal(plain_step[name], step[name]), name
