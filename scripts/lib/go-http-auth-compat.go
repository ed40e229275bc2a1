// What Traefik's fork of github.com/abbot/go-http-auth (github.com/containous/go-http-auth, not
// served by the Go module proxy) adds to abbot/go-http-auth v0.4.0 and Traefik calls:
// CheckSecret and DigestAuth.RequireAuthStale. scripts/build-gateway.sh copies this file into
// its copy of v0.4.0; it is not built anywhere else.
package auth

import (
	"fmt"
	"net/http"
	"strings"
	"time"
)

// CheckSecret reports whether password matches secret (an htpasswd entry: MD5 crypt, {SHA} or
// bcrypt), compared as BasicAuth.CheckAuth compares them.
func CheckSecret(password, secret string) bool {
	compare := compareFuncs[0].compare
	for _, cmp := range compareFuncs[1:] {
		if strings.HasPrefix(secret, cmp.prefix) {
			compare = cmp.compare
			break
		}
	}
	return compare([]byte(secret), []byte(password)) == nil
}

// RequireAuthStale is RequireAuth telling the client its nonce went stale (RFC 2617 stale=true),
// so it retries with a fresh nonce without asking the user again.
func (a *DigestAuth) RequireAuthStale(w http.ResponseWriter, r *http.Request) {
	if len(a.clients) > a.ClientCacheSize+a.ClientCacheTolerance {
		a.Purge(a.ClientCacheTolerance * 2)
	}
	nonce := RandomKey()
	a.clients[nonce] = &digest_client{nc: 0, last_seen: time.Now().UnixNano()}
	w.Header().Set(contentType, a.Headers.V().UnauthContentType)
	w.Header().Set(a.Headers.V().Authenticate,
		fmt.Sprintf(`Digest realm="%s", nonce="%s", opaque="%s", algorithm="MD5", qop="auth", stale=true`,
			a.Realm, nonce, a.Opaque))
	w.WriteHeader(a.Headers.V().UnauthCode)
	w.Write([]byte(a.Headers.V().UnauthResponse))
}
