import jax, jax.numpy as jnp

def make(batch: int = 256):
    k = jax.random.PRNGKey(0)
    w8 = jax.random.randint(k, (1024, 1024), -127, 127).astype(jnp.int8)
    scale = jnp.ones((1024,), jnp.float32) * 0.01
    wf8 = (jax.random.normal(k, (1024, 512)) * 0.1).astype(jnp.float8_e4m3fn)
    x = jnp.ones((batch, 1024), jnp.bfloat16)
    def infer(w8, scale, wf8, x):
        xq = jnp.clip(jnp.round(x * 16), -127, 127).astype(jnp.int8)
        acc = jax.lax.dot(xq, w8, preferred_element_type=jnp.int32)
        h = jax.nn.relu(acc.astype(jnp.float32) * scale / 16).astype(jnp.float8_e4m3fn)
        out = jax.lax.dot(h, wf8, preferred_element_type=jnp.float32)
        return out.astype(jnp.bfloat16), (acc > 0)
    return infer, (w8, scale, wf8, x)

def make_int4(batch: int = 64):
    k = jax.random.PRNGKey(0)
    w4 = jax.random.randint(k, (512, 512), -7, 7).astype(jnp.int4)
    x = jnp.ones((batch, 512), jnp.bfloat16)
    def infer(w4, x):
        return x @ w4.astype(jnp.bfloat16)
    return infer, (w4, x)
