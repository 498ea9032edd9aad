"""dm-haiku encoder-decoder transformer (hk.MultiHeadAttention for encoder self-attention, causal decoder self-attention and decoder-to-encoder cross-attention), hk.LayerNorm, teacher-forced translation loss, optax Adam."""
import jax, jax.numpy as jnp, haiku as hk, optax

V, D, H, L, S, T = 8000, 256, 8, 3, 128, 96


def ffn(x):
    return hk.Linear(D)(jax.nn.relu(hk.Linear(4 * D)(x)))


def ln(x):
    return hk.LayerNorm(-1, True, True)(x)


def model(src, tgt_in):
    emb = hk.Embed(V, D)
    x = emb(src) + hk.get_parameter('pos_e', (S, D), init=hk.initializers.RandomNormal(0.02))
    for _ in range(L):
        y = ln(x)
        x = x + hk.MultiHeadAttention(H, D // H, w_init=hk.initializers.VarianceScaling(1.0))(y, y, y)
        x = x + ffn(ln(x))
    mem = ln(x)
    z = emb(tgt_in) + hk.get_parameter('pos_d', (T, D), init=hk.initializers.RandomNormal(0.02))
    causal = jnp.tril(jnp.ones((1, 1, T, T), bool))
    for _ in range(L):
        y = ln(z)
        z = z + hk.MultiHeadAttention(H, D // H, w_init=hk.initializers.VarianceScaling(1.0))(y, y, y, mask=causal)
        z = z + hk.MultiHeadAttention(H, D // H, w_init=hk.initializers.VarianceScaling(1.0))(ln(z), mem, mem)
        z = z + ffn(ln(z))
    return hk.Linear(V)(ln(z))


def make(batch: int = 16):
    net = hk.without_apply_rng(hk.transform(model))
    src = jnp.zeros((batch, S), jnp.int32); tgt = jnp.zeros((batch, T + 1), jnp.int32)
    params = net.init(jax.random.PRNGKey(0), src, tgt[:, :-1])
    tx = optax.adam(5e-4)
    opt_state = tx.init(params)

    def step(params, opt_state, src, tgt):
        def loss_fn(p):
            logits = net.apply(p, src, tgt[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tgt[:, 1:]).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step, (params, opt_state, src, tgt)
