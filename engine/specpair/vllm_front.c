/* The vLLM companion's compiled front (issue 53: <= 5% of a core at 200 requests/s).
 *
 * One thread of its own (epoll) accepts the companion's plaintext HTTP port and relays the hot
 * path itself: a POST to /v1/completions or /v1/chat/completions, Content-Length body, HTTP/1.1,
 * the bearer token exactly as configured, a JSON object whose top-level "specpair" (if any) is
 * {"category": "<name>"} and with no "stream_options". It is sent to vLLM on kept-alive Unix
 * socket connections ("stream_options": {"include_usage": true} spliced into a streamed one), the
 * reply's streamed events pass through (the usage chunk dropped: the client did not ask for it),
 * and Python gets one record a request (vllm_front_native.py reads them in batches).
 *
 * Anything else (another path or method, chunked or Expect bodies, a token that does not match
 * byte for byte, a body this scan does not read plainly, a draining companion, a bad head) is not
 * answered here: the connection, with the bytes read so far, is handed over to the Python front
 * (vllm_front.FrontConnection), which answers it and keeps it to its end. So every rule of the
 * Python front holds; this file only makes the common request cheap.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>

#define MAX_HEAD (64 << 10)
#define MAX_BODY (64 << 20)
#define MAX_WHOLE (1 << 20)         /* a whole (not streamed) reply kept for its usage, at most */
#define OUT_HIGH (1 << 20)          /* client output waiting: vLLM's connection stops being read */

enum { K_LISTEN = 1, K_CLIENT, K_UP, K_WAKE };
/* A request's outcome as the companion counts it (vllm_companion.Reply.status). */
enum { ST_OK = 0, ST_ERROR, ST_INVALID, ST_CANCELLED, ST_UNAVAILABLE };

typedef struct { char *p; size_t len, cap; } buf_t;

static int buf_reserve(buf_t *b, size_t more) {
    if (b->len + more <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + more) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) return -1;
    b->p = p; b->cap = cap;
    return 0;
}
static int buf_add(buf_t *b, const void *data, size_t n) {
    if (buf_reserve(b, n + 1)) return -1;
    memcpy(b->p + b->len, data, n);
    b->len += n;
    b->p[b->len] = 0;
    return 0;
}
static int buf_adds(buf_t *b, const char *s) { return buf_add(b, s, strlen(s)); }
static void buf_drop(buf_t *b, size_t n) {
    if (n >= b->len) { b->len = 0; return; }
    memmove(b->p, b->p + n, b->len - n);
    b->len -= n;
}
static void buf_free(buf_t *b) { free(b->p); b->p = NULL; b->len = b->cap = 0; }

typedef struct up up_t;
typedef struct client {
    int kind, fd;
    buf_t in, out;
    size_t out_off;
    int busy, keep_alive, dead;
    int watching_out;           /* EPOLLOUT asked for (changed only when it must: a system call) */
    up_t *up;
    /* the request in flight */
    buf_t request;              /* as sent to vLLM (kept for one retry on a fresh connection) */
    char category[65];
    int stream, retried, started, done_seen, status, error_event, whole_reply;
    double arrived, first_at;
    buf_t head;                 /* the reply's head to the client, held until its first event */
    buf_t held;                 /* events held with it ([DONE] alone is no start) */
    buf_t finals;               /* payloads of events that name "usage" or "error"; or the whole body */
    struct client *prev_all, *next_all;
} client_t;

struct up {
    int kind, fd;
    buf_t in, out;
    size_t out_off;
    client_t *client;
    int reused, replied, head_done, chunked, reusable, paused, idle;
    uint32_t watched;           /* the epoll events asked for now */
    long long left;             /* Content-Length bytes left; -1: chunked or until close */
    /* chunked decoding */
    int cstate;                 /* 0 size line, 1 data, 2 CRLF after data, 3 trailers, 4 done */
    long long cleft;
    buf_t sse;                  /* decoded event bytes not yet a whole event */
    up_t *next_idle;
};

typedef struct front {
    int ep, listen_fd, wake_fd, notify_fd, stop, handover_all;
    char upstream[108];         /* a Unix socket's path, or empty: upstream_addr (TCP) */
    struct sockaddr_in upstream_addr;
    char host[160];             /* the Host header vLLM is sent */
    client_t *clients;          /* every open client connection (closed at stop) */
    char token[512];
    size_t token_len;
    pthread_t thread;
    pthread_mutex_t lock;
    buf_t records, handovers;
    volatile int in_flight;
    up_t *idle;
    int running;
    double listen_resume;       /* out of descriptors: the listening socket unwatched till then */
} front_t;

/* The front the running thread serves (each front has a thread of its own). */
static __thread front_t *F;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void set_nonblock(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

static void ep_set(int fd, void *ptr, uint32_t events, int add) {
    struct epoll_event ev = { .events = events, .data.ptr = ptr };
    epoll_ctl(F->ep, add ? EPOLL_CTL_ADD : EPOLL_CTL_MOD, fd, &ev);
}

/* -- records and handovers (read by Python) ------------------------------------------------------ */

static void put_u32(buf_t *b, uint32_t v) { buf_add(b, &v, 4); }
static void put_f64(buf_t *b, double v) { buf_add(b, &v, 8); }

/* One counted request: u32 total, u8 status, u8 flags (1 first event seen, 2 whole reply body,
 * 4 [DONE] seen), u16 category length, f64 first event and end (seconds after arrival, -1: none),
 * u32 finals length; the category; the finals (u32 length + payload each, or the whole body). */
static void record(client_t *c, int status) {
    double end = now_s();
    size_t cat = strlen(c->category);
    uint32_t total = 4 + 1 + 1 + 2 + 8 + 8 + 4 + (uint32_t)cat + (uint32_t)c->finals.len;
    uint8_t st = (uint8_t)status, flags = (c->first_at > 0) | (c->whole_reply ? 2 : 0) | (c->done_seen ? 4 : 0);
    uint16_t cl = (uint16_t)cat;
    pthread_mutex_lock(&F->lock);
    put_u32(&F->records, total);
    buf_add(&F->records, &st, 1);
    buf_add(&F->records, &flags, 1);
    buf_add(&F->records, &cl, 2);
    put_f64(&F->records, c->first_at > 0 ? c->first_at - c->arrived : -1.0);
    put_f64(&F->records, end - c->arrived);
    put_u32(&F->records, (uint32_t)c->finals.len);
    buf_add(&F->records, c->category, cat);
    if (c->finals.len) buf_add(&F->records, c->finals.p, c->finals.len);
    __sync_fetch_and_sub(&F->in_flight, 1);
    pthread_mutex_unlock(&F->lock);
    c->finals.len = 0;
}

static void free_client(client_t *c);

/* The connection goes to the Python front with the bytes read from it so far. */
static void hand_over(client_t *c) {
    epoll_ctl(F->ep, EPOLL_CTL_DEL, c->fd, NULL);
    int fd = c->fd;
    c->fd = -1;
    pthread_mutex_lock(&F->lock);
    put_u32(&F->handovers, (uint32_t)fd);
    put_u32(&F->handovers, (uint32_t)c->in.len);
    if (c->in.len) buf_add(&F->handovers, c->in.p, c->in.len);
    pthread_mutex_unlock(&F->lock);
    char one = 1;
    if (write(F->notify_fd, &one, 1) < 0) { /* a full pipe: Python is already woken */ }
    free_client(c);
}

/* -- output ------------------------------------------------------------------------------------- */

static void close_client(client_t *c);
static void up_close(up_t *u);

static void up_watch(up_t *u) {
    uint32_t ev = (u->paused ? 0 : EPOLLIN) | (u->out.len > u->out_off ? EPOLLOUT : 0) | EPOLLRDHUP;
    if (ev != u->watched) { u->watched = ev; ep_set(u->fd, u, ev, 0); }
}

/* Writes what waits for the client; 0, or -1: the client is gone. */
static int client_flush(client_t *c) {
    while (c->out.len > c->out_off) {
        ssize_t n = send(c->fd, c->out.p + c->out_off, c->out.len - c->out_off, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            return -1;
        }
        c->out_off += (size_t)n;
    }
    if (c->out_off == c->out.len) c->out.len = c->out_off = 0;
    else if (c->out_off > (64 << 10) && c->out_off * 2 > c->out.len) {
        buf_drop(&c->out, c->out_off);      /* what was written goes: the buffer stays near its bound */
        c->out_off = 0;
    }
    int waiting = c->out.len > c->out_off;
    if (waiting != c->watching_out) {
        c->watching_out = waiting;
        ep_set(c->fd, c, EPOLLIN | EPOLLRDHUP | (waiting ? EPOLLOUT : 0), 0);
    }
    up_t *u = c->up;
    if (u && u->paused != (c->out.len - c->out_off > OUT_HIGH)) {
        u->paused = !u->paused;         /* the client reads slower than vLLM writes */
        up_watch(u);
    }
    return 0;
}

static int up_flush(up_t *u) {
    while (u->out.len > u->out_off) {
        ssize_t n = send(u->fd, u->out.p + u->out_off, u->out.len - u->out_off, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            return -1;
        }
        u->out_off += (size_t)n;
    }
    if (u->out_off == u->out.len) u->out.len = u->out_off = 0;
    up_watch(u);
    return 0;
}

static void chunk_to(buf_t *b, const char *data, size_t n) {
    char size[24];
    int k = snprintf(size, sizeof size, "%zx\r\n", n);
    buf_add(b, size, (size_t)k);
    buf_add(b, data, n);
    buf_add(b, "\r\n", 2);
}

static const char *reason(int status) {
    /* Python's http.HTTPStatus phrases (the Python front's), for what vLLM answers a completion */
    switch (status) {
    case 200: return "OK"; case 201: return "Created"; case 202: return "Accepted"; case 204: return "No Content";
    case 400: return "Bad Request"; case 401: return "Unauthorized"; case 403: return "Forbidden";
    case 404: return "Not Found"; case 405: return "Method Not Allowed"; case 408: return "Request Timeout";
    case 409: return "Conflict"; case 413: return "Request Entity Too Large";
    case 422: return "Unprocessable Entity"; case 429: return "Too Many Requests";
    case 500: return "Internal Server Error"; case 501: return "Not Implemented"; case 502: return "Bad Gateway";
    case 503: return "Service Unavailable"; case 504: return "Gateway Timeout";
    default: return "Unknown";
    }
}

static void json_escape(buf_t *b, const char *s) {
    for (; *s; s++) {
        if (*s == '"' || *s == '\\') { buf_add(b, "\\", 1); buf_add(b, s, 1); }
        else if ((unsigned char)*s < 0x20) { char e[8]; snprintf(e, sizeof e, "\\u%04x", *s); buf_adds(b, e); }
        else buf_add(b, s, 1);
    }
}

/* OpenAI's error shape, as vllm_companion._respond_error writes it. */
static void respond_error(client_t *c, int status, const char *message, const char *kind, int retry_after) {
    buf_t body = {0};
    buf_adds(&body, "{\"error\": {\"message\": \"");
    json_escape(&body, message);
    char tail[160];
    snprintf(tail, sizeof tail, "\", \"type\": \"%s\", \"param\": null, \"code\": %d}}", kind, status);
    buf_adds(&body, tail);
    char head[320];
    int k = snprintf(head, sizeof head, "HTTP/1.1 %d %s\r\nContent-Type: application/json; charset=utf-8\r\n%s"
                     "Content-Length: %zu\r\n%s\r\n", status, reason(status), retry_after ? "Retry-After: 1\r\n" : "",
                     body.len, c->keep_alive ? "" : "Connection: close\r\n");
    buf_add(&c->out, head, (size_t)k);
    buf_add(&c->out, body.p, body.len);
    buf_free(&body);
}

/* -- requests ------------------------------------------------------------------------------------ */

/* The bearer token compared in constant time (as the Python front's hmac.compare_digest): memcmp
   returns at the first byte that differs, which tells a client timing it how much it guessed. */
static int same_token(const char *given, const char *token, size_t n) {
    unsigned char diff = 0;
    for (size_t i = 0; i < n; i++) diff |= (unsigned char)(given[i] ^ token[i]);
    return diff == 0;
}

static int header_is(const char *name, size_t n, const char *want) {
    return strlen(want) == n && strncasecmp(name, want, n) == 0;
}

static const char *skip_ws(const char *p, const char *end) {
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n')) p++;
    return p;
}

/* The end of the JSON string starting at p (at its opening quote), past its closing quote; NULL:
 * unterminated. `escaped`: it holds a backslash. */
static const char *string_end(const char *p, const char *end, int *escaped) {
    *escaped = 0;
    for (p++; p < end; p++) {
        if (*p == '\\') { *escaped = 1; p++; continue; }
        if (*p == '"') return p + 1;
    }
    return NULL;
}

/* The end of the JSON value starting at p: strings skipped, brackets counted (not validated:
 * vLLM reads the body and refuses what is not JSON). NULL where it runs off the end. */
static const char *value_end(const char *p, const char *end) {
    int depth = 0, esc;
    while (p < end) {
        char ch = *p;
        if (ch == '"') { p = string_end(p, end, &esc); if (!p) return NULL; if (!depth) return p; continue; }
        if (ch == '{' || ch == '[') depth++;
        else if (ch == '}' || ch == ']') { if (--depth < 0) return p; if (!depth) return p + 1; }
        else if (!depth && (ch == ',' )) return p;
        p++;
    }
    return NULL;
}

static int category_char(char ch) {
    return (ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '_' ||
           ch == '.' || ch == '-';
}

/* Reads a counted request's body as vllm_companion.prepare does, where it is plain: 1 with the
 * category and stream set, 0 where Python must read it (then the connection is handed over). */
static int scan_body(const char *p, size_t n, char *category, int *stream) {
    const char *end = p + n;
    int seen_specpair = 0, seen_stream = 0, esc;
    category[0] = 0;            /* none: Python counts it in the default category (contract.py) */
    *stream = 0;
    if (n < 2 || p[0] != '{') return 0;
    if (!memchr(p, '}', n)) return 0;
    p = skip_ws(p + 1, end);
    if (p < end && *p == '}') return 1;
    while (p < end) {
        if (*p != '"') return 0;
        const char *key = p + 1, *kend = string_end(p, end, &esc);
        if (!kend || esc) return 0;
        size_t klen = (size_t)(kend - 1 - key);
        p = skip_ws(kend, end);
        if (p >= end || *p != ':') return 0;
        p = skip_ws(p + 1, end);
        const char *v = p, *vend = value_end(p, end);
        if (!vend || vend == v) return 0;
        if (klen == 14 && !memcmp(key, "stream_options", 14)) return 0;
        if (klen == 6 && !memcmp(key, "stream", 6)) {
            if (seen_stream++) return 0;
            *stream = (vend - v == 4 && !memcmp(v, "true", 4));
        } else if (klen == 8 && !memcmp(key, "specpair", 8)) {
            /* {"category": "<1-64 of A-Z a-z 0-9 _ . ->"} exactly, else Python's reading */
            if (seen_specpair++ || *v != '{') return 0;
            const char *q = skip_ws(v + 1, vend);
            if (vend - q < 11 || memcmp(q, "\"category\"", 10)) return 0;
            q = skip_ws(q + 10, vend);
            if (q >= vend || *q != ':') return 0;
            q = skip_ws(q + 1, vend);
            if (q >= vend || *q != '"') return 0;
            const char *name = ++q;
            while (q < vend && category_char(*q)) q++;
            size_t len = (size_t)(q - name);
            if (q >= vend || *q != '"' || len > 64) return 0;
            q = skip_ws(q + 1, vend);
            if (q + 1 != vend || *q != '}') return 0;
            if (len) { memcpy(category, name, len); category[len] = 0; }
        }
        p = skip_ws(vend, end);
        if (p >= end) return 0;
        if (*p == ',') { p = skip_ws(p + 1, end); continue; }
        if (*p != '}') return 0;
        p = skip_ws(p + 1, end);
        return p == end;            /* nothing after the object */
    }
    return 0;
}

static void start_relay(client_t *c);

static const char *DROPPED[] = {"connection", "keep-alive", "transfer-encoding", "content-length", "host",
                                "authorization", "upgrade", "proxy-connection", "te", "trailer", "expect", NULL};

/* The next request on a client connection: relayed, handed over, or not whole yet. */
static void client_read_request(client_t *c) {
    /* The next request waits until the last reply is all written: a connection handed over, or
     * a reply that fails early, never overtakes the bytes still due before it. */
    if (c->busy || c->fd < 0 || !c->in.len || c->out.len > c->out_off) return;
    char *hend = memmem(c->in.p, c->in.len, "\r\n\r\n", 4);
    if (!hend) {
        if (c->in.len > MAX_HEAD) hand_over(c);
        return;
    }
    if (F->handover_all) { hand_over(c); return; }
    size_t head_len = (size_t)(hend - c->in.p) + 4;
    char *p = c->in.p, *line_end = memmem(p, head_len, "\r\n", 2);
    char *sp1 = memchr(p, ' ', (size_t)(line_end - p));
    char *sp2 = sp1 ? memchr(sp1 + 1, ' ', (size_t)(line_end - sp1 - 1)) : NULL;
    if (!sp1 || !sp2 || sp1 - p != 4 || memcmp(p, "POST", 4) || line_end - sp2 - 1 != 8 ||
        memcmp(sp2 + 1, "HTTP/1.1", 8)) { hand_over(c); return; }
    char *target = sp1 + 1;
    size_t target_len = (size_t)(sp2 - target), path_len = target_len;
    char *q = memchr(target, '?', target_len);
    if (q) path_len = (size_t)(q - target);
    if (!((path_len == 15 && !memcmp(target, "/v1/completions", 15)) ||
          (path_len == 20 && !memcmp(target, "/v1/chat/completions", 20)))) { hand_over(c); return; }
    long long length = -1;
    int keep_alive = 1, auth_ok = F->token_len == 0;
    buf_t fwd = {0};
    buf_add(&fwd, "POST ", 5);
    buf_add(&fwd, target, target_len);
    buf_adds(&fwd, " HTTP/1.1\r\nHost: ");
    buf_adds(&fwd, F->host);
    buf_adds(&fwd, "\r\n");
    for (char *l = line_end + 2; l < hend; ) {
        char *e = memmem(l, (size_t)(hend + 2 - l), "\r\n", 2);
        char *colon = memchr(l, ':', (size_t)(e - l));
        if (!colon || colon == l || colon[-1] == ' ' || colon[-1] == '\t' || *l == ' ' || *l == '\t') {
            buf_free(&fwd); hand_over(c); return;
        }
        size_t nlen = (size_t)(colon - l);
        char *v = colon + 1, *vend = e;
        while (v < vend && (*v == ' ' || *v == '\t')) v++;
        while (vend > v && (vend[-1] == ' ' || vend[-1] == '\t')) vend--;
        size_t vlen = (size_t)(vend - v);
        if (header_is(l, nlen, "transfer-encoding") || header_is(l, nlen, "expect")) {
            buf_free(&fwd); hand_over(c); return;
        }
        if (header_is(l, nlen, "content-length")) {
            char *num_end;
            char tmp[24];
            if (vlen == 0 || vlen > 20 || length >= 0) { buf_free(&fwd); hand_over(c); return; }
            memcpy(tmp, v, vlen); tmp[vlen] = 0;
            length = strtoll(tmp, &num_end, 10);
            if (*num_end || length < 0 || length > MAX_BODY) { buf_free(&fwd); hand_over(c); return; }
        } else if (header_is(l, nlen, "connection")) {
            for (size_t i = 0; i + 5 <= vlen; i++) if (!strncasecmp(v + i, "close", 5)) keep_alive = 0;
        } else if (header_is(l, nlen, "authorization")) {
            auth_ok = F->token_len && vlen == 7 + F->token_len && !memcmp(v, "Bearer ", 7) &&
                      same_token(v + 7, F->token, F->token_len);
        }
        int dropped = 0;
        for (const char **d = DROPPED; *d; d++) if (header_is(l, nlen, *d)) { dropped = 1; break; }
        if (!dropped) { buf_add(&fwd, l, (size_t)(e - l)); buf_add(&fwd, "\r\n", 2); }
        l = e + 2;
    }
    if (!auth_ok || length < 0) { buf_free(&fwd); hand_over(c); return; }
    if (c->in.len < head_len + (size_t)length) { buf_free(&fwd); return; }    /* the body is not whole yet */
    const char *body = c->in.p + head_len;
    int stream;
    if (!scan_body(body, (size_t)length, c->category, &stream)) { buf_free(&fwd); hand_over(c); return; }
    static const char SPLICE[] = ", \"stream_options\": {\"include_usage\": true}";
    size_t body_len = (size_t)length + (stream ? sizeof SPLICE - 1 : 0);
    char cl[48];
    snprintf(cl, sizeof cl, "Content-Length: %zu\r\n\r\n", body_len);
    buf_adds(&fwd, cl);
    if (stream) {
        /* before the object's closing brace (the last "}"), as prepare() splices it */
        const char *close = body + length - 1;
        while (*close != '}') close--;
        buf_add(&fwd, body, (size_t)(close - body));
        buf_add(&fwd, SPLICE, sizeof SPLICE - 1);
        buf_add(&fwd, close, (size_t)(body + length - close));
    } else {
        buf_add(&fwd, body, (size_t)length);
    }
    buf_drop(&c->in, head_len + (size_t)length);
    buf_free(&c->request);
    c->request = fwd;
    c->keep_alive = keep_alive;
    c->stream = stream;
    c->busy = 1;
    c->retried = c->started = c->done_seen = c->error_event = c->whole_reply = 0;
    c->status = ST_OK;
    c->first_at = 0;
    c->head.len = c->held.len = c->finals.len = 0;
    c->arrived = now_s();
    __sync_fetch_and_add(&F->in_flight, 1);
    start_relay(c);
}

/* -- vLLM's side ----------------------------------------------------------------------------------- */

static up_t *up_connect(char *why, size_t why_len) {
    int unix_socket = F->upstream[0] != 0;
    int fd = socket(unix_socket ? AF_UNIX : AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    strncpy(addr.sun_path, F->upstream, sizeof addr.sun_path - 1);
    /* (a blocking connect: to the pod's own vLLM it is answered at once, or refused) */
    int made = fd < 0 ? -1 : unix_socket ? connect(fd, (struct sockaddr *)&addr, sizeof addr)
                                         : connect(fd, (struct sockaddr *)&F->upstream_addr, sizeof F->upstream_addr);
    if (!unix_socket && fd >= 0) { int one = 1; setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); }
    if (fd < 0 || made < 0) {
        snprintf(why, why_len, "[Errno %d] %s", errno, strerror(errno));
        if (fd >= 0) close(fd);
        return NULL;
    }
    set_nonblock(fd);
    up_t *u = calloc(1, sizeof *u);
    u->kind = K_UP;
    u->fd = fd;
    u->watched = EPOLLIN | EPOLLRDHUP;
    ep_set(fd, u, u->watched, 1);
    return u;
}

static void finish_request(client_t *c);

static void relay_unavailable(client_t *c, const char *why) {
    char message[400];
    snprintf(message, sizeof message, "vLLM is not answering: %s", why);
    record(c, ST_UNAVAILABLE);
    respond_error(c, 503, message, "service_unavailable", 0);
    finish_request(c);
}

static void send_request(client_t *c, up_t *u) {
    c->up = u;
    u->client = c;
    u->replied = u->head_done = u->chunked = u->paused = 0;
    u->reusable = 1;
    u->left = -1;
    u->cstate = 0;
    u->in.len = u->sse.len = 0;
    buf_add(&u->out, c->request.p, c->request.len);
    if (up_flush(u) < 0) { /* seen as a lost connection on its next event */ }
}

static void start_relay(client_t *c) {
    up_t *u = F->idle;
    if (u) { F->idle = u->next_idle; u->idle = 0; u->reused = 1; send_request(c, u); return; }
    char why[300];
    u = up_connect(why, sizeof why);
    if (!u) { relay_unavailable(c, why); return; }
    u->reused = 0;
    send_request(c, u);
}

/* The request is answered: the client connection reads its next one (or closes). */
static void finish_request(client_t *c) {
    c->busy = 0;
    c->up = NULL;
    if (client_flush(c) < 0) { close_client(c); return; }
    if (!c->keep_alive) {
        if (c->out.len == c->out_off) close_client(c);
        else c->dead = 1;       /* closed once the reply is written */
        return;
    }
    client_read_request(c);
}

static void up_release(up_t *u, int keep) {
    u->client = NULL;
    if (keep && u->reusable && !u->paused) { u->idle = 1; u->next_idle = F->idle; F->idle = u; up_watch(u); }
    else up_close(u);
}

static void up_close(up_t *u) {
    if (u->idle) {
        up_t **pp = &F->idle;
        while (*pp && *pp != u) pp = &(*pp)->next_idle;
        if (*pp) *pp = u->next_idle;
    }
    epoll_ctl(F->ep, EPOLL_CTL_DEL, u->fd, NULL);
    close(u->fd);
    buf_free(&u->in); buf_free(&u->out); buf_free(&u->sse);
    free(u);
}

/* Whole events out of the decoded stream: those naming "usage" or "error" copied for Python, the
 * usage chunk dropped (the companion asked for it), the rest passed on; the client's reply head
 * waits for the first event other than [DONE]. `last`: the stream ended, a partial event goes too. */
static void pass_events(client_t *c, up_t *u, int last) {
    buf_t *s = &u->sse;
    size_t cut = 0;
    for (size_t i = s->len; i >= 2; i--) if (s->p[i - 2] == '\n' && s->p[i - 1] == '\n') { cut = i; break; }
    if (last) cut = s->len;
    if (!cut) return;
    if (c->first_at == 0 && cut >= 2) c->first_at = now_s();
    buf_t kept = {0};
    const char *p = s->p, *end = s->p + cut;
    int any_content = 0;
    while (p < end) {
        const char *e = memmem(p, (size_t)(end - p), "\n\n", 2);
        const char *next = e ? e + 2 : end;
        size_t n = (size_t)(next - p);
        int drop = 0;
        if (n >= 14 && !memcmp(p, "data: [DONE]\n\n", 14)) c->done_seen = 1;
        else {
            if (n > 6 && !memcmp(p, "data: ", 6) && (memmem(p, n, "\"usage\"", 7) || memmem(p, n, "\"error\"", 7))) {
                const char *payload = p + 6;
                uint32_t plen = (uint32_t)(e ? e - payload : end - payload);
                put_u32(&c->finals, plen);
                buf_add(&c->finals, payload, plen);
                /* the usage chunk: "usage" an object and no choices ("choices":[]) */
                const char *us = memmem(p, n, "\"usage\":", 8);
                if (us && us + 8 < next && us[8] == '{' &&
                    (!memmem(p, n, "\"choices\"", 9) || memmem(p, n, "\"choices\":[]", 12))) drop = 1;
            }
            for (size_t i = 0; !drop && !any_content && i < n; i++)
                if (p[i] != '\n' && p[i] != '\r' && p[i] != ' ') any_content = 1;
        }
        if (!drop) buf_add(&kept, p, n);
        p = next;
    }
    buf_drop(s, cut);
    if (!c->started) {
        buf_add(&c->held, kept.p ? kept.p : "", kept.len);
        if (any_content) {
            c->started = 1;
            buf_add(&c->out, c->head.p, c->head.len);
            if (c->held.len) chunk_to(&c->out, c->held.p, c->held.len);
            c->held.len = 0;
        }
    } else if (kept.len) {
        chunk_to(&c->out, kept.p, kept.len);
    }
    buf_free(&kept);
}

/* vLLM's reply ended whole. */
static void reply_end(client_t *c, up_t *u) {
    if (c->stream && c->status == ST_OK && c->head.len && !c->whole_reply) {
        pass_events(c, u, 1);
        if (!c->started) {
            /* vLLM closed the stream before its first event (vllm_companion._Relay.on_end) */
            int keep = c->keep_alive;
            up_release(u, 1);
            c->up = NULL;
            record(c, ST_UNAVAILABLE);
            c->keep_alive = keep;
            respond_error(c, 503, "vLLM closed the stream before its first event (it is shutting down); send "
                          "the request to another pod", "service_unavailable", 1);
            finish_request(c);
            return;
        }
        buf_add(&c->out, "0\r\n\r\n", 5);
    } else if (c->head.len == 0) {
        /* a chunked whole reply: its last chunk */
        buf_add(&c->out, "0\r\n\r\n", 5);
    }
    up_release(u, 1);
    c->up = NULL;
    record(c, c->status);
    finish_request(c);
}

/* The client's reply head (status line, vLLM's headers but the hop-by-hop ones, our framing). */
static void reply_head(client_t *c, buf_t *to, int status, const char *hstart, const char *hend,
                       long long length) {
    char line[64];
    int k = snprintf(line, sizeof line, "HTTP/1.1 %d %s\r\n", status, reason(status));
    buf_add(to, line, (size_t)k);
    for (const char *l = hstart; l < hend; ) {
        const char *e = memmem(l, (size_t)(hend + 2 - l), "\r\n", 2);
        const char *colon = memchr(l, ':', (size_t)(e - l));
        if (colon) {
            size_t nlen = (size_t)(colon - l);
            int dropped = 0;
            for (const char **d = DROPPED; *d; d++) if (header_is(l, nlen, *d)) { dropped = 1; break; }
            if (!dropped) {
                const char *v = colon + 1;
                while (v < e && *v == ' ') v++;
                buf_add(to, l, nlen);
                buf_add(to, ": ", 2);
                buf_add(to, v, (size_t)(e - v));
                buf_add(to, "\r\n", 2);
            }
        }
        l = e + 2;
    }
    if (length < 0) buf_adds(to, "Transfer-Encoding: chunked\r\n");
    else { k = snprintf(line, sizeof line, "Content-Length: %lld\r\n", length); buf_add(to, line, (size_t)k); }
    if (!c->keep_alive) buf_adds(to, "Connection: close\r\n");
    buf_add(to, "\r\n", 2);
}

/* Body bytes of vLLM's reply, decoded. */
static void reply_body(client_t *c, up_t *u, const char *data, size_t n) {
    if (!n) return;
    if (c->whole_reply) {
        if (c->status == ST_OK && c->finals.len + n <= MAX_WHOLE) buf_add(&c->finals, data, n);
        if (c->head.len == 0) chunk_to(&c->out, data, n);     /* chunked to the client */
        else buf_add(&c->out, data, n);
        return;
    }
    buf_add(&u->sse, data, n);
    pass_events(c, u, 0);
}

static void up_lost(up_t *u, const char *why);

/* Bytes from vLLM: 1 while the reply goes on, 0 ended (u released), -1 broken (u closed). */
static int up_received(up_t *u) {
    client_t *c = u->client;
    u->replied = 1;
    if (!u->head_done) {
        char *hend = memmem(u->in.p, u->in.len, "\r\n\r\n", 4);
        if (!hend) {
            if (u->in.len > MAX_HEAD) { up_lost(u, "vLLM's reply head too large"); return -1; }
            return 1;
        }
        size_t head_len = (size_t)(hend - u->in.p) + 4;
        char *line_end = memmem(u->in.p, head_len, "\r\n", 2);
        if (u->in.len < 12 || memcmp(u->in.p, "HTTP/1.", 7)) { up_lost(u, "vLLM's reply is not HTTP/1.x"); return -1; }
        int status = atoi(u->in.p + 9);
        if (status >= 100 && status < 200) { buf_drop(&u->in, head_len); return u->in.len ? up_received(u) : 1; }
        if (memcmp(u->in.p, "HTTP/1.1", 8)) u->reusable = 0;
        long long length = -1;
        int chunked = 0, event_stream = 0;
        for (char *l = line_end + 2; l < hend; ) {
            char *e = memmem(l, (size_t)(hend + 2 - l), "\r\n", 2);
            char *colon = memchr(l, ':', (size_t)(e - l));
            if (colon) {
                size_t nlen = (size_t)(colon - l);
                char *v = colon + 1;
                while (v < e && *v == ' ') v++;
                size_t vlen = (size_t)(e - v);
                if (header_is(l, nlen, "content-length")) length = atoll(v);
                else if (header_is(l, nlen, "transfer-encoding")) chunked = memmem(v, vlen, "chunked", 7) != NULL;
                else if (header_is(l, nlen, "connection") && memmem(v, vlen, "close", 5)) u->reusable = 0;
                else if (header_is(l, nlen, "content-type")) event_stream = vlen >= 17 && !strncmp(v, "text/event-stream", 17);
            }
            l = e + 2;
        }
        u->head_done = 1;
        u->chunked = chunked;
        u->left = chunked ? -1 : length;
        if (!chunked && length < 0) u->reusable = 0;      /* ends with the connection */
        if (status >= 400) c->status = status < 500 ? ST_INVALID : ST_ERROR;
        c->head.len = 0;
        if (c->stream && status < 400 && event_stream && chunked) {
            reply_head(c, &c->head, status, line_end + 2, hend, -1);     /* held for the first event */
        } else {
            c->whole_reply = 1;
            c->started = 1;
            buf_t head = {0};
            reply_head(c, &head, status, line_end + 2, hend, chunked || length < 0 ? -1 : length);
            buf_add(&c->out, head.p, head.len);
            buf_free(&head);
            if (!chunked && length >= 0) c->head.len = 1;     /* marks "Content-Length to the client" */
            if (status == 204 || status == 304) u->left = 0;
        }
        buf_drop(&u->in, head_len);
        if (u->left == 0) { reply_end(c, u); return 0; }
    }
    if (!u->chunked) {
        size_t take = u->in.len;
        if (u->left >= 0 && (long long)take > u->left) take = (size_t)u->left;
        reply_body(c, u, u->in.p, take);
        buf_drop(&u->in, take);
        if (u->left >= 0) {
            u->left -= (long long)take;
            if (!u->left) { reply_end(c, u); return 0; }
        }
        return 1;
    }
    /* chunked: decode what is here */
    size_t pos = 0;
    buf_t *in = &u->in;
    while (pos < in->len) {
        if (u->cstate == 1) {
            size_t take = in->len - pos;
            if ((long long)take > u->cleft) take = (size_t)u->cleft;
            reply_body(c, u, in->p + pos, take);
            pos += take;
            u->cleft -= (long long)take;
            if (u->cleft) break;
            u->cstate = 2;
            continue;
        }
        if (u->cstate == 2) {
            if (in->len - pos < 2) break;
            if (memcmp(in->p + pos, "\r\n", 2)) { up_lost(u, "chunk not followed by CRLF"); return -1; }
            pos += 2;
            u->cstate = 0;
            continue;
        }
        char *eol = memmem(in->p + pos, in->len - pos, "\r\n", 2);
        if (!eol) {
            if (in->len - pos > 1024) { up_lost(u, "chunk size line too long"); return -1; }
            break;
        }
        if (u->cstate == 3) {            /* trailers, up to the empty line */
            int empty = eol == in->p + pos;
            pos = (size_t)(eol - in->p) + 2;
            if (empty) { buf_drop(in, pos); reply_end(c, u); return 0; }
            continue;
        }
        char *num_end;
        long long size = strtoll(in->p + pos, &num_end, 16);
        if (num_end == in->p + pos || (num_end != eol && *num_end != ';') || size < 0) {
            up_lost(u, "bad chunk size"); return -1;
        }
        pos = (size_t)(eol - in->p) + 2;
        if (size == 0) u->cstate = 3;
        else { u->cstate = 1; u->cleft = size; }
    }
    buf_drop(in, pos);
    if (client_flush(c) < 0) { /* the client's own event reports it */ }
    return 1;
}

/* vLLM's connection went, or its reply broke: retried once when it was a kept-alive one that
 * closed before replying; else 503 before the reply started, a cut reply after. */
static void up_lost(up_t *u, const char *why) {
    client_t *c = u->client;
    int replied = u->replied, reused = u->reused;
    u->client = NULL;
    up_close(u);
    if (!c) return;
    c->up = NULL;
    if (!replied && reused && !c->retried) {
        c->retried = 1;
        char reason_[300];
        up_t *fresh = up_connect(reason_, sizeof reason_);
        if (!fresh) { relay_unavailable(c, reason_); return; }
        send_request(c, fresh);
        return;
    }
    if (!c->started) {
        relay_unavailable(c, why);      /* (nothing of this reply was written: its head is held) */
        return;
    }
    record(c, ST_ERROR);
    c->keep_alive = 0;              /* the client sees a cut reply, not a short one */
    finish_request(c);
}

static void up_event(up_t *u, uint32_t events) {
    if (events & EPOLLOUT) { if (up_flush(u) < 0) { up_lost(u, "the connection closed"); return; } }
    if (!(events & (EPOLLIN | EPOLLHUP | EPOLLERR | EPOLLRDHUP))) return;
    for (;;) {
        if (buf_reserve(&u->in, 65536)) { up_lost(u, "out of memory"); return; }
        ssize_t n = recv(u->fd, u->in.p + u->in.len, 65536, 0);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) return;
            if (errno == EINTR) continue;
            char why[120];
            snprintf(why, sizeof why, "[Errno %d] %s", errno, strerror(errno));
            up_lost(u, why);
            return;
        }
        if (n == 0) {
            client_t *c = u->client;
            if (c && u->head_done && !u->chunked && u->left < 0) { reply_end(c, u); return; }   /* ends with close */
            up_lost(u, "the connection closed");
            return;
        }
        if (!u->client) { up_close(u); return; }      /* bytes with no request in flight: not reusable */
        u->in.len += (size_t)n;
        if (up_received(u) <= 0) return;
        if ((size_t)n < 65536 || u->paused) return;
    }
}

/* -- clients ------------------------------------------------------------------------------------- */

static void free_client(client_t *c) {
    if (c->prev_all) c->prev_all->next_all = c->next_all;
    else if (F->clients == c) F->clients = c->next_all;
    if (c->next_all) c->next_all->prev_all = c->prev_all;
    if (c->fd >= 0) { epoll_ctl(F->ep, EPOLL_CTL_DEL, c->fd, NULL); close(c->fd); }
    buf_free(&c->in); buf_free(&c->out); buf_free(&c->request); buf_free(&c->head); buf_free(&c->held);
    buf_free(&c->finals);
    free(c);
}

/* The client went: vLLM's connection is closed (vLLM aborts the request); a stream whose [DONE]
 * it had was whole. */
static void close_client(client_t *c) {
    if (c->busy) {
        up_t *u = c->up;
        if (u) { u->client = NULL; up_close(u); }
        c->up = NULL;
        record(c, c->status == ST_OK && !c->done_seen ? ST_CANCELLED : c->status);
        c->busy = 0;
    }
    free_client(c);
}

static void client_event(client_t *c, uint32_t events) {
    if (events & EPOLLOUT) {
        if (client_flush(c) < 0) { close_client(c); return; }
        if (c->dead && c->out.len == c->out_off) { close_client(c); return; }
        if (!(events & (EPOLLIN | EPOLLHUP | EPOLLERR | EPOLLRDHUP))) {
            if (!c->busy && !c->dead) client_read_request(c);     /* a request waited for the write */
            return;
        }
    }
    if (!(events & (EPOLLIN | EPOLLHUP | EPOLLERR | EPOLLRDHUP))) return;
    for (;;) {
        if (buf_reserve(&c->in, 65536)) { close_client(c); return; }
        ssize_t n = recv(c->fd, c->in.p + c->in.len, 65536, 0);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            if (errno == EINTR) continue;
            close_client(c);
            return;
        }
        if (n == 0) { close_client(c); return; }
        c->in.len += (size_t)n;
        if ((size_t)n < 65536) break;
    }
    if (c->dead) return;
    if (!c->busy) client_read_request(c);
    else if (c->in.len > MAX_HEAD + MAX_BODY) close_client(c);
}

static int K_LISTEN_TAG;

/* Out of descriptors or memory, the pending connection stays readable and a level-triggered
   epoll would wake this thread for it without end (a core spinning until a descriptor frees):
   the listening socket is unwatched for a second instead, as asyncio's accept does. */
#define ACCEPT_RETRY_S 1.0
static void listen_watch(int on) {
    struct epoll_event ev = { .events = on ? EPOLLIN : 0, .data.ptr = &K_LISTEN_TAG };
    epoll_ctl(F->ep, EPOLL_CTL_MOD, F->listen_fd, &ev);
    F->listen_resume = on ? 0 : now_s() + ACCEPT_RETRY_S;
}

static void accept_all(void) {
    for (;;) {
        int fd = accept4(F->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) listen_watch(0);
            return;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        client_t *c = calloc(1, sizeof *c);
        if (!c) { close(fd); listen_watch(0); return; }
        c->kind = K_CLIENT;
        c->fd = fd;
        c->keep_alive = 1;
        c->next_all = F->clients;
        if (F->clients) F->clients->prev_all = c;
        F->clients = c;
        ep_set(fd, c, EPOLLIN | EPOLLRDHUP, 1);
    }
}

static void *run(void *arg) {
    (void)arg;
    struct epoll_event events[128];
    while (!F->stop) {
        int wait_ms = -1;
        if (F->listen_resume) {
            double left = F->listen_resume - now_s();
            wait_ms = left > 0 ? (int)(left * 1000) + 1 : 0;
        }
        int n = epoll_wait(F->ep, events, 128, wait_ms);
        if (F->listen_resume && now_s() >= F->listen_resume) listen_watch(1);
        for (int i = 0; i < n && !F->stop; i++) {
            int *kind = events[i].data.ptr;
            if (*kind == K_LISTEN) accept_all();
            else if (*kind == K_CLIENT) client_event((client_t *)kind, events[i].events);
            else if (*kind == K_UP) {
                up_t *u = (up_t *)kind;
                if (u->idle && (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLRDHUP | EPOLLERR))) up_close(u);
                else up_event(u, events[i].events);
            }
        }
    }
    return NULL;
}

static int K_LISTEN_TAG = K_LISTEN, K_WAKE_TAG = K_WAKE;

/* -- the interface Python calls (ctypes) ---------------------------------------------------------- */

static void *thread_main(void *arg) {
    F = arg;
    run(NULL);
    /* stopped: every connection this front holds is closed */
    while (F->clients) close_client(F->clients);
    while (F->idle) up_close(F->idle);
    return NULL;
}

/* A front on `listen_fd` (listening) in front of vLLM at `upstream` ("unix:PATH" or
 * "IPV4:PORT"); `host` the Host header vLLM gets; `token` the bearer token ("" for none);
 * `notify_fd` gets a byte when a connection is handed over. NULL where it cannot start. */
front_t *spf_start(int listen_fd, const char *upstream, const char *host, const char *token, int notify_fd) {
    front_t *f = calloc(1, sizeof *f);
    if (!f) return NULL;
    pthread_mutex_init(&f->lock, NULL);
    f->listen_fd = listen_fd;
    f->notify_fd = notify_fd;
    if (strlen(host) >= sizeof f->host || strlen(token) >= sizeof f->token) { free(f); return NULL; }
    strcpy(f->host, host);
    strcpy(f->token, token);
    f->token_len = strlen(token);
    if (!strncmp(upstream, "unix:", 5)) {
        if (strlen(upstream + 5) >= sizeof f->upstream || !upstream[5]) { free(f); return NULL; }
        strcpy(f->upstream, upstream + 5);
    } else {
        char ip[64];
        const char *colon = strrchr(upstream, ':');
        if (!colon || colon - upstream >= (long)sizeof ip) { free(f); return NULL; }
        memcpy(ip, upstream, (size_t)(colon - upstream));
        ip[colon - upstream] = 0;
        f->upstream_addr.sin_family = AF_INET;
        f->upstream_addr.sin_port = htons((uint16_t)atoi(colon + 1));
        if (inet_pton(AF_INET, ip, &f->upstream_addr.sin_addr) != 1) { free(f); return NULL; }
    }
    f->ep = epoll_create1(EPOLL_CLOEXEC);
    f->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (f->ep < 0 || f->wake_fd < 0) { free(f); return NULL; }
    set_nonblock(listen_fd);
    struct epoll_event ev = { .events = EPOLLIN, .data.ptr = &K_LISTEN_TAG };
    epoll_ctl(f->ep, EPOLL_CTL_ADD, listen_fd, &ev);
    ev.data.ptr = &K_WAKE_TAG;
    epoll_ctl(f->ep, EPOLL_CTL_ADD, f->wake_fd, &ev);
    if (pthread_create(&f->thread, NULL, thread_main, f)) { close(f->ep); close(f->wake_fd); free(f); return NULL; }
    f->running = 1;
    return f;
}

static char *take(front_t *f, buf_t *b, size_t *n) {
    pthread_mutex_lock(&f->lock);
    char *p = b->p;
    *n = b->len;
    b->p = NULL;
    b->len = b->cap = 0;
    pthread_mutex_unlock(&f->lock);
    return p;
}

/* The records gathered since the last call (malloc'd: spf_free), their byte count in *n. */
char *spf_take_records(front_t *f, size_t *n) { return take(f, &f->records, n); }

/* The connections handed over since the last call: u32 fd, u32 length, the bytes read. */
char *spf_take_handovers(front_t *f, size_t *n) { return take(f, &f->handovers, n); }

void spf_free(char *p) { free(p); }

int spf_in_flight(front_t *f) { return __sync_fetch_and_add(&f->in_flight, 0); }

/* 1: every new request goes to the Python front (draining: it refuses them). */
void spf_handover_all(front_t *f, int on) { f->handover_all = on; }

/* Stops the thread and closes the connections it holds (records of those in flight: cancelled);
 * the records and handovers not yet taken stay for spf_take_*; then spf_destroy. */
void spf_stop(front_t *f) {
    if (!f->running) return;
    f->stop = 1;
    uint64_t one = 1;
    if (write(f->wake_fd, &one, 8) < 0) { /* the thread is woken anyway */ }
    pthread_join(f->thread, NULL);
    f->running = 0;
    close(f->ep);
    close(f->wake_fd);
}

void spf_destroy(front_t *f) {
    buf_free(&f->records);
    buf_free(&f->handovers);
    pthread_mutex_destroy(&f->lock);
    free(f);
}
