// The prefix cache's block hash, as the gateway computes it (protocols/prefix_hash.py): block k's hash is the
// first 8 bytes of BLAKE2b (digest size 8, no key) of block k-1's hash (8 bytes, little-endian) followed by
// block k's token ids (int32, little-endian), read as a little-endian u64, 0 made 1. The scheduler extends a
// request's chain with it over the blocks the request's own decoding fills (blink_prefix_cache.h), so that the
// next turn of a conversation, whose prompt holds this answer, finds them. Host and device (one thread).
// (The gateway chains raw digests; a digest of 0, read as 1 here, would part the chains: odds 2^-64.)
#ifndef BLINK_BLOCK_HASH_H
#define BLINK_BLOCK_HASH_H

#include <stdint.h>

BLINK_HD uint64_t blink_rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

BLINK_HD void blink_blake2b_g(uint64_t* v, int a, int b, int c, int d, uint64_t x, uint64_t y) {
  v[a] = v[a] + v[b] + x;
  v[d] = blink_rotr64(v[d] ^ v[a], 32);
  v[c] = v[c] + v[d];
  v[b] = blink_rotr64(v[b] ^ v[c], 24);
  v[a] = v[a] + v[b] + y;
  v[d] = blink_rotr64(v[d] ^ v[a], 16);
  v[c] = v[c] + v[d];
  v[b] = blink_rotr64(v[b] ^ v[c], 63);
}

// RFC 7693's compression F of one 128-byte block `m` into `h`; `t`: bytes hashed so far, `last`: final block.
BLINK_HD void blink_blake2b_compress(uint64_t* h, const uint64_t* m, uint64_t t, int last) {
  const uint64_t iv[8] = {0x6a09e667f3bcc908ull, 0xbb67ae8584caa73bull, 0x3c6ef372fe94f82bull, 0xa54ff53a5f1d36f1ull,
                          0x510e527fade682d1ull, 0x9b05688c2b3e6c1full, 0x1f83d9abfb41bd6bull, 0x5be0cd19137e2179ull};
  const uint8_t sigma[12][16] = {
      {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
      {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
      {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
      {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
      {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
      {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};
  uint64_t v[16];
  for (int i = 0; i < 8; ++i) {
    v[i] = h[i];
    v[i + 8] = iv[i];
  }
  v[12] ^= t;
  if (last) v[14] = ~v[14];
  for (int r = 0; r < 12; ++r) {
    const uint8_t* s = sigma[r];
    blink_blake2b_g(v, 0, 4, 8, 12, m[s[0]], m[s[1]]);
    blink_blake2b_g(v, 1, 5, 9, 13, m[s[2]], m[s[3]]);
    blink_blake2b_g(v, 2, 6, 10, 14, m[s[4]], m[s[5]]);
    blink_blake2b_g(v, 3, 7, 11, 15, m[s[6]], m[s[7]]);
    blink_blake2b_g(v, 0, 5, 10, 15, m[s[8]], m[s[9]]);
    blink_blake2b_g(v, 1, 6, 11, 12, m[s[10]], m[s[11]]);
    blink_blake2b_g(v, 2, 7, 8, 13, m[s[12]], m[s[13]]);
    blink_blake2b_g(v, 3, 4, 9, 14, m[s[14]], m[s[15]]);
  }
  for (int i = 0; i < 8; ++i) h[i] ^= v[i] ^ v[i + 8];
}

// Word w (little-endian u64) of the message `prev` . tokens[0, n).
BLINK_HD uint64_t blink_block_hash_word(uint64_t prev, const int32_t* tokens, int32_t n, int64_t w) {
  if (w == 0) return prev;
  const int64_t i = 2 * (w - 1);
  const uint64_t lo = (uint32_t)tokens[i], hi = i + 1 < n ? (uint32_t)tokens[i + 1] : 0u;
  return lo | hi << 32;
}

// The hash of the block of `n` tokens after the block whose hash is `prev`.
BLINK_HD uint64_t blink_block_hash(uint64_t prev, const int32_t* tokens, int32_t n) {
  uint64_t h[8] = {0x6a09e667f3bcc908ull ^ 0x01010008ull, 0xbb67ae8584caa73bull, 0x3c6ef372fe94f82bull,
                   0xa54ff53a5f1d36f1ull, 0x510e527fade682d1ull, 0x9b05688c2b3e6c1full, 0x1f83d9abfb41bd6bull,
                   0x5be0cd19137e2179ull};  // parameter block: digest length 8, fanout 1, depth 1
  const int64_t total = 8 + 4 * (int64_t)n, words = (total + 7) / 8;
  for (int64_t first = 0;; first += 16) {
    uint64_t m[16];
    for (int64_t j = 0; j < 16; ++j) m[j] = first + j < words ? blink_block_hash_word(prev, tokens, n, first + j) : 0;
    const int last = (first + 16) * 8 >= total;
    blink_blake2b_compress(h, m, (uint64_t)(last ? total : (first + 16) * 8), last);
    if (last) break;
  }
  return h[0] ? h[0] : 1;
}

#endif  // BLINK_BLOCK_HASH_H
