"""Training steps whose losses and gradients the offloading tests compare with and without offload."""


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
