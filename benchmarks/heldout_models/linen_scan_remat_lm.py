"""Flax linen decoder-only LM whose blocks are stacked with nn.scan over layers and wrapped in nn.remat, causal nn.SelfAttention with a mask, tied embeddings (nn.Embed.attend), clip-by-global-norm then AdamW with a warmup-cosine schedule."""
import jax, jax.numpy as jnp, optax
import flax.linen as nn

V, D, H, L, T = 8192, 384, 6, 6, 256


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.SelfAttention(num_heads=H, deterministic=True)(nn.LayerNorm()(x), mask=mask)
        h = nn.Dense(4 * D)(nn.LayerNorm()(x))
        x = x + nn.Dense(D)(nn.gelu(h))
        return x, None


class LM(nn.Module):
    @nn.compact
    def __call__(self, tok):
        emb = nn.Embed(V, D)
        x = emb(tok) + self.param('pos', nn.initializers.normal(0.02), (T, D))
        Stack = nn.scan(nn.remat(Block), variable_axes={'params': 0}, split_rngs={'params': True}, length=L)
        x, _ = Stack()(x, None)
        return emb.attend(nn.LayerNorm()(x))


def make(batch: int = 8):
    model = LM()
    tok = jnp.zeros((batch, T + 1), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), tok[:, :-1])['params']
    sched = optax.warmup_cosine_decay_schedule(0.0, 3e-4, 100, 10000)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.1))
    opt_state = tx.init(params)

    def step(params, opt_state, tok):
        def loss_fn(p):
            logits = model.apply({'params': p}, tok[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tok[:, 1:]).mean()
        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss
    return step, (params, opt_state, tok)
