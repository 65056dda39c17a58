//! Deterministic pseudo-random test data (xorshift64 from a seed), shared by
//! the integration tests and the VM example `lwio-e2e-vm`, which includes
//! this file with `#[path]`.

/// `len` bytes determined by `seed` (different seeds give different data).
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
