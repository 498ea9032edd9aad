"""Plain-JAX message-passing graph network (edge MLP on gathered sender/receiver features, jax.ops.segment_sum aggregation to nodes, node MLP update, several rounds) for node regression, optax Adam."""
import jax, jax.numpy as jnp, optax

NODES, EDGES, F, HID, ROUNDS = 20000, 160000, 32, 128, 4


def mlp_init(key, sizes):
    ks = jax.random.split(key, len(sizes) - 1)
    return [{'w': jax.random.normal(k, (a, b)) * a ** -0.5, 'b': jnp.zeros(b)} for k, a, b in zip(ks, sizes[:-1], sizes[1:])]


def mlp(ps, x):
    for i, p in enumerate(ps):
        x = x @ p['w'] + p['b']
        if i < len(ps) - 1:
            x = jax.nn.silu(x)
    return x


def make():
    ks = jax.random.split(jax.random.PRNGKey(0), 2 + 2 * ROUNDS)
    params = {'enc': mlp_init(ks[0], [F, HID, HID]), 'dec': mlp_init(ks[1], [HID, HID, 1]),
              'edge': [mlp_init(ks[2 + i], [3 * HID, HID, HID]) for i in range(ROUNDS)],
              'node': [mlp_init(ks[2 + ROUNDS + i], [2 * HID, HID, HID]) for i in range(ROUNDS)]}
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)
    kk = jax.random.split(jax.random.PRNGKey(1), 4)
    nodes = jax.random.normal(kk[0], (NODES, F))
    senders = jax.random.randint(kk[1], (EDGES,), 0, NODES)
    receivers = jax.random.randint(kk[2], (EDGES,), 0, NODES)
    edge_feat = jnp.ones((EDGES, HID))
    target = jnp.zeros((NODES, 1))

    def loss_fn(p, nodes, senders, receivers, edge_feat, target):
        h = mlp(p['enc'], nodes); e = edge_feat
        for ep, np_ in zip(p['edge'], p['node']):
            e = e + mlp(ep, jnp.concatenate([e, h[senders], h[receivers]], -1))
            agg = jax.ops.segment_sum(e, receivers, num_segments=NODES)
            h = h + mlp(np_, jnp.concatenate([h, agg], -1))
        return jnp.mean((mlp(p['dec'], h) - target) ** 2)

    def step(params, opt_state, nodes, senders, receivers, edge_feat, target):
        loss, g = jax.value_and_grad(loss_fn)(params, nodes, senders, receivers, edge_feat, target)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss
    return step, (params, opt_state, nodes, senders, receivers, edge_feat, target)
