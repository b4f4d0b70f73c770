/* The poller's round for plain streams, in C (`gateway/streaming/stream_round.py` is its Python face).
 *
 * A plain stream is one choice of a streamed response with no stop strings and no logprobs, on a ring in
 * this host's shared memory, whose first chunk has gone out. Each token of it costs the Python poller
 * about 20-35 us (a poll, a TokenUpdate, the detokenizer, the chunk, the write); here it costs a table
 * lookup, a JSON escape and the socket write. Everything else stays Python's: a round returns the slots
 * with news it did not deliver (other requests', finishes, anything unusual), and Python takes a stream
 * back (`sr_take_back`) before it touches it.
 *
 * What a plain stream's chunk is, the Python path defines (`gateway/api/sse.py`, `gateway/request/detokenize.py`):
 * - text: the tokens' pieces (a byte table from `TokenPieces`), decoded as UTF-8 as characters complete:
 *   an incomplete character's bytes wait for the next token; an invalid sequence (which Python would turn
 *   into U+FFFD) goes back to Python with the bytes before it still pending;
 * - the chunk: the template's bytes around the text as a JSON string (`json.encoder.encode_basestring`:
 *   quoted, `"` `\` and controls escaped, lowercase \u00XX, non-ASCII left as UTF-8), as one HTTP/1.1 chunk;
 * - one send per chunk on a dup of the connection's socket, never blocking: a chunk the kernel takes
 *   only in part leaves its rest for Python's transport, one it does not take at all goes back to Python.
 *
 * Ring words: every word has one writer. The engine writes produced (after the tokens) and finish (after
 * the last produced); the gateway writes consumed. Acquire loads pair with the engine's release stores.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define SR_TEMPLATE_BYTES 1024  /* a slot's chunk head + tail; longer templates stay on Python's path */
#define SR_MAX_TEXT_BYTES 16384 /* an update's text bytes; more go back to Python */
#define SR_SCRATCH_BYTES (6 * SR_MAX_TEXT_BYTES + SR_TEMPLATE_BYTES + 64) /* size line, quotes, CRLF */

/* sr_ring (what the Python side fills once per ring), sr_taken (a stream's state as it goes back to Python),
 * sr_tap (a benchmark's tap) and the SR_BACK_* reasons: generated from gateway/stream_round_decl.py
 * (`python -m protocols.layout.gen`), as is their Python side (gateway/streaming/stream_round_layout.py). */
#include "stream_round_layout.h"

/* A stream's state while C delivers it; the same fields go back to Python in `sr_taken`. */
typedef struct {
    int32_t fd;           /* our dup of the socket; -1: not ours */
    uint32_t live;        /* 1: C delivers it; 0: not, or handed back (fd kept until `sr_take_back`) */
    uint64_t seq;         /* the request's seq: the response's words are this request's */
    uint32_t consumed;    /* tokens read from the response */
    uint32_t num_tokens;  /* tokens the stream has taken (the usage count) */
    uint32_t budget;      /* the most num_tokens may reach (a key's budget); UINT32_MAX: none */
    uint32_t tokens_left; /* max_tokens - tokens produced: the router's outstanding-token count */
    uint32_t chunked;     /* HTTP/1.1 chunked framing (else the body runs to the close) */
    uint32_t num_pending; /* bytes of an incomplete character */
    uint8_t pending[4];
    uint32_t head_len, tail_len;
    int64_t last_token_ns;
    uint64_t bytes_sent;
    uint8_t *unsent;      /* a chunk's rest the kernel did not take: Python's transport writes it */
    uint32_t unsent_len;
    uint32_t reason;      /* why it was handed back (SR_BACK_*) */
    uint8_t templ[SR_TEMPLATE_BYTES]; /* "data: " + head, then tail + "\n\n" */
} sr_slot;

typedef struct {
    sr_ring ring;
    sr_slot *slots;
    uint8_t *scratch;   /* one chunk being built */
    uint8_t *text;      /* its text */
    sr_tap *tap;
} sr_state;

static uint32_t load_u32(const uint8_t *p) { return __atomic_load_n((const uint32_t *)p, __ATOMIC_ACQUIRE); }
static uint64_t load_u64(const uint8_t *p) { return __atomic_load_n((const uint64_t *)p, __ATOMIC_ACQUIRE); }

sr_state *sr_create(const sr_ring *ring) {
    sr_state *st = calloc(1, sizeof *st);
    if (!st) return NULL;
    st->ring = *ring;
    st->slots = calloc(ring->num_slots, sizeof *st->slots);
    st->scratch = malloc(SR_SCRATCH_BYTES);
    st->text = malloc(SR_MAX_TEXT_BYTES + 4);
    if (!st->slots || !st->scratch || !st->text) {
        free(st->slots); free(st->scratch); free(st->text); free(st);
        return NULL;
    }
    for (uint32_t i = 0; i < ring->num_slots; i++) st->slots[i].fd = -1;
    return st;
}

static void slot_clear(sr_slot *s) {
    if (s->fd >= 0) close(s->fd);
    free(s->unsent);
    s->fd = -1; s->live = 0; s->unsent = NULL; s->unsent_len = 0;
}

void sr_destroy(sr_state *st) {
    if (!st) return;
    for (uint32_t i = 0; i < st->ring.num_slots; i++) slot_clear(&st->slots[i]);
    free(st->slots); free(st->scratch); free(st->text); free(st);
}

void sr_set_tap(sr_state *st, sr_tap *tap) { st->tap = tap; }

uint32_t sr_template_bytes(void) { return SR_TEMPLATE_BYTES; }

/* C delivers `slot` from now on, writing to a dup of `fd`. 0, or -1 (errno: EINVAL for a template too
 * long or a slot out of range; dup's errno). */
int sr_enable(sr_state *st, uint32_t slot, int fd, uint64_t seq, uint32_t consumed, uint32_t num_tokens,
              uint32_t budget, uint32_t tokens_left, uint32_t chunked, const uint8_t *pending, uint32_t num_pending,
              const uint8_t *head, uint32_t head_len, const uint8_t *tail, uint32_t tail_len) {
    if (slot >= st->ring.num_slots || num_pending > 3 || head_len + tail_len > SR_TEMPLATE_BYTES) {
        errno = EINVAL;
        return -1;
    }
    sr_slot *s = &st->slots[slot];
    slot_clear(s);
    int dup_fd = dup(fd);
    if (dup_fd < 0) return -1;
    s->fd = dup_fd; s->live = 1; s->seq = seq; s->consumed = consumed; s->num_tokens = num_tokens;
    s->budget = budget; s->tokens_left = tokens_left; s->chunked = chunked; s->num_pending = num_pending;
    memcpy(s->pending, pending, num_pending);
    s->head_len = head_len; s->tail_len = tail_len;
    memcpy(s->templ, head, head_len);
    memcpy(s->templ + head_len, tail, tail_len);
    s->last_token_ns = 0; s->bytes_sent = 0; s->reason = SR_BACK_NONE;
    return 0;
}

/* Python takes `slot` back: its state into `out`, the rest of a partly sent chunk into `unsent` (room for
 * `out->unsent_len` bytes: call with NULL first to learn it, then with the buffer). 1 if the slot was C's
 * (its fd closed once `unsent` is copied), 0 if not. */
int sr_take_back(sr_state *st, uint32_t slot, sr_taken *out, uint8_t *unsent) {
    if (slot >= st->ring.num_slots || st->slots[slot].fd < 0) return 0;
    sr_slot *s = &st->slots[slot];
    s->live = 0;
    out->consumed = (int32_t)s->consumed; out->num_tokens = (int32_t)s->num_tokens;
    out->num_pending = (int32_t)s->num_pending; memcpy(out->pending, s->pending, 4);
    out->unsent_len = (int32_t)s->unsent_len; out->reason = (int32_t)s->reason;
    out->last_token_ns = s->last_token_ns; out->bytes_sent = s->bytes_sent;
    if (s->unsent_len && !unsent) return 1;  /* the caller asks again with room */
    if (s->unsent_len) memcpy(unsent, s->unsent, s->unsent_len);
    slot_clear(s);
    return 1;
}

/* Length of the longest prefix of b[0, n) that is whole valid UTF-8 characters; `*tail` gets the length of
 * an incomplete but valid character after it (0-3). Returns -1 if an invalid sequence comes first (Python's
 * decoder rules: no overlongs, no surrogates, nothing over U+10FFFF). */
static int64_t utf8_prefix(const uint8_t *b, uint32_t n, uint32_t *tail) {
    uint32_t i = 0;
    *tail = 0;
    while (i < n) {
        uint8_t c = b[i];
        if (c < 0x80) { i++; continue; }
        uint32_t len; uint8_t lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) len = 2;
        else if (c >= 0xE0 && c <= 0xEF) { len = 3; if (c == 0xE0) lo = 0xA0; if (c == 0xED) hi = 0x9F; }
        else if (c >= 0xF0 && c <= 0xF4) { len = 4; if (c == 0xF0) lo = 0x90; if (c == 0xF4) hi = 0x8F; }
        else return -1;
        for (uint32_t k = 1; k < len; k++) {
            if (i + k == n) { *tail = k; return i; }  /* valid so far, incomplete */
            uint8_t d = b[i + k];
            if (d < (k == 1 ? lo : 0x80) || d > (k == 1 ? hi : 0xBF)) return -1;
        }
        i += len;
    }
    return i;
}

/* `encode_basestring` of UTF-8 text, into `dst` (room for 6 bytes per input byte); returns its length. */
static uint32_t json_escape(uint8_t *dst, const uint8_t *src, uint32_t n) {
    static const char hex[] = "0123456789abcdef";
    uint8_t *d = dst;
    for (uint32_t i = 0; i < n; i++) {
        uint8_t c = src[i];
        if (c >= 0x20 && c != '"' && c != '\\') { *d++ = c; continue; }
        *d++ = '\\';
        switch (c) {
        case '"': *d++ = '"'; break;
        case '\\': *d++ = '\\'; break;
        case '\n': *d++ = 'n'; break;
        case '\r': *d++ = 'r'; break;
        case '\t': *d++ = 't'; break;
        case '\b': *d++ = 'b'; break;
        case '\f': *d++ = 'f'; break;
        default: *d++ = 'u'; *d++ = '0'; *d++ = '0'; *d++ = hex[c >> 4]; *d++ = hex[c & 15];
        }
    }
    return (uint32_t)(d - dst);
}

static uint32_t put_hex(uint8_t *dst, uint32_t v) {
    char tmp[8]; uint32_t n = 0;
    do { tmp[n++] = "0123456789abcdef"[v & 15]; v >>= 4; } while (v);
    for (uint32_t k = 0; k < n; k++) dst[k] = (uint8_t)tmp[n - 1 - k];
    return n;
}

static void tap_record(sr_tap *tap, const uint8_t *frame, uint32_t len) {
    if (tap->num_entries >= tap->cap_entries || tap->num_bytes + len > tap->cap_bytes) return;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    memcpy(tap->bytes + tap->num_bytes, frame, len);
    tap->num_bytes += len;
    tap->times_ns[tap->num_entries] = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    tap->ends[tap->num_entries++] = (int64_t)tap->num_bytes;
}

/* One update of a live slot with news: SR_BACK_NONE when delivered (or nothing to send yet), else why it
 * goes back to Python (nothing of the update consumed, except after SR_BACK_PARTIAL). */
static uint32_t deliver(sr_state *st, sr_slot *s, const uint8_t *resp, uint32_t produced, int64_t now_ns,
                        uint64_t *drop) {
    const sr_ring *r = &st->ring;
    uint32_t n = produced - s->consumed;
    if (n > r->max_output_len) return SR_BACK_TOKEN;
    if ((uint64_t)s->num_tokens + n >= s->budget) return SR_BACK_BUDGET;  /* Python ends the stream there */
    const int32_t *tokens = (const int32_t *)(resp + r->off_tokens);
    uint8_t *text = st->text;
    uint32_t len = s->num_pending;
    memcpy(text, s->pending, len);
    for (uint32_t k = 0; k < n; k++) {
        int32_t id = tokens[(s->consumed + k) % r->max_output_len];
        if (id < 0 || (uint32_t)id >= r->vocab_size) return SR_BACK_TOKEN;
        uint32_t a = r->piece_offsets[id], b = r->piece_offsets[id + 1];
        if (len + (b - a) > SR_MAX_TEXT_BYTES) return SR_BACK_SIZE;
        memcpy(text + len, r->piece_bytes + a, b - a);
        len += b - a;
    }
    uint32_t tail;
    int64_t whole = utf8_prefix(text, len, &tail);
    if (whole < 0) return SR_BACK_UTF8;
    uint32_t sent = 0, frame_len = 0;
    if (whole > 0) {
        uint8_t *f = st->scratch, *p = f + 8;  /* room for the chunk's size line */
        memcpy(p, s->templ, s->head_len);
        uint32_t body = s->head_len;
        p[body++] = '"';
        body += json_escape(p + body, text, (uint32_t)whole);
        p[body++] = '"';
        memcpy(p + body, s->templ + s->head_len, s->tail_len);
        body += s->tail_len;
        if (s->chunked) {
            uint8_t line[10]; uint32_t h = put_hex(line, body);
            line[h] = '\r'; line[h + 1] = '\n';
            p -= h + 2;
            memcpy(p, line, h + 2);
            memcpy(p + h + 2 + body, "\r\n", 2);
            frame_len = h + 2 + body + 2;
        } else {
            frame_len = body;
        }
        ssize_t w = send(s->fd, p, frame_len, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w < 0) return (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? SR_BACK_AGAIN : SR_BACK_ERROR;
        sent = (uint32_t)w;
        if (st->tap && sent) tap_record(st->tap, p, sent);
        if (sent < frame_len) {
            s->unsent = malloc(frame_len - sent);
            if (!s->unsent) return SR_BACK_ERROR;  /* the connection is then broken mid-chunk: Python ends it */
            memcpy(s->unsent, p + sent, frame_len - sent);
            s->unsent_len = frame_len - sent;
        }
    }
    /* delivered: commit the update */
    uint32_t fell = n < s->tokens_left ? n : s->tokens_left;
    s->tokens_left -= fell;
    *drop += fell;
    s->consumed = produced;
    s->num_tokens += n;
    s->num_pending = tail;
    memcpy(s->pending, text + whole, tail);
    s->last_token_ns = now_ns;
    s->bytes_sent += sent;
    __atomic_store_n((uint32_t *)(resp + r->off_consumed), produced, __ATOMIC_RELEASE);
    return sent < frame_len ? SR_BACK_PARTIAL : SR_BACK_NONE;
}

/* One poll round over `slots` (the requests in flight, in ring order): delivers the news of live slots,
 * and writes into `out` the slots whose news is Python's (not live, or handed back now: those are no
 * longer live, and Python must `sr_take_back` them before it polls them). Returns how many; `stats` gets
 * [updates delivered, outstanding tokens that fell (the router's count)]. */
int32_t sr_round(sr_state *st, const int32_t *slots, int32_t num_slots, int64_t now_ns, int32_t *out,
                 uint64_t *stats) {
    const sr_ring *r = &st->ring;
    int32_t num_out = 0;
    uint64_t delivered = 0, drop = 0;
    for (int32_t i = 0; i < num_slots; i++) {
        uint32_t slot = (uint32_t)slots[i];
        if (slot >= r->num_slots) continue;
        const uint8_t *resp = r->ring + r->responses_offset + (uint64_t)slot * r->response_bytes;
        sr_slot *s = &st->slots[slot];
        uint32_t finish = load_u32(resp + r->off_finish);  /* before produced: tokens up to it are final */
        uint32_t produced = load_u32(resp + r->off_produced);
        if (!s->live) {
            if (finish || produced != load_u32(resp + r->off_consumed)) out[num_out++] = (int32_t)slot;
            continue;
        }
        uint32_t reason = SR_BACK_NONE;
        if (load_u64(resp + r->off_seq) != s->seq) reason = SR_BACK_SEQ;
        else if (finish) reason = SR_BACK_FINISH;
        else if (produced == s->consumed) continue;
        else {
            reason = deliver(st, s, resp, produced, now_ns, &drop);
            if (reason == SR_BACK_NONE || reason == SR_BACK_PARTIAL) delivered++;
            if (reason == SR_BACK_NONE) continue;
        }
        s->live = 0;
        s->reason = reason;
        out[num_out++] = (int32_t)slot;
    }
    stats[0] = delivered;
    stats[1] = drop;
    return num_out;
}
