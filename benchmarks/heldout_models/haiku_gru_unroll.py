"""dm-haiku character-level language model: a two-layer hk.DeepRNN of hk.GRU cores unrolled over time with hk.dynamic_unroll (time-major), global-norm clipping then Adam."""
import jax, jax.numpy as jnp, haiku as hk, optax

V, HID, T = 256, 512, 128


def model(tok):
    B = tok.shape[1]
    x = hk.Embed(V, 128)(tok)
    core = hk.DeepRNN([hk.GRU(HID), jax.nn.relu, hk.GRU(HID)])
    out, _ = hk.dynamic_unroll(core, x, core.initial_state(B))
    return hk.Linear(V)(out)


def make(batch: int = 64):
    net = hk.without_apply_rng(hk.transform(model))
    tok = jnp.zeros((T + 1, batch), jnp.int32)
    params = net.init(jax.random.PRNGKey(0), tok[:-1])
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(2e-3))
    opt_state = tx.init(params)

    def step(params, opt_state, tok):
        def loss_fn(p):
            return optax.softmax_cross_entropy_with_integer_labels(net.apply(p, tok[:-1]), tok[1:]).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step, (params, opt_state, tok)
