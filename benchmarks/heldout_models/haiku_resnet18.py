"""dm-haiku ResNet18 (hk.nets.ResNet18) under hk.transform_with_state with batch-norm state, on 64x64 images, optax SGD-momentum with weight decay."""
import jax, jax.numpy as jnp, haiku as hk, optax


def forward(x, is_training):
    return hk.nets.ResNet18(num_classes=100, resnet_v2=False)(x, is_training=is_training)


def make(batch: int = 32):
    net = hk.transform_with_state(forward)
    x = jnp.ones((batch, 64, 64, 3)); y = jnp.zeros((batch,), jnp.int32)
    params, state = net.init(jax.random.PRNGKey(0), x, is_training=True)
    tx = optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(0.1, momentum=0.9))
    opt_state = tx.init(params)

    def train_step(params, state, opt_state, x, y):
        def loss_fn(params, state):
            logits, state = net.apply(params, state, None, x, is_training=True)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), state
        (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), state, opt_state, loss
    return train_step, (params, state, opt_state, x, y)
