"""A request's way from its body to its tokens and back: `pipeline` (the one path HTTP and gRPC take), `limits`,
`tokenize`, `generate` (one choice in flight), `choices` (a request's n choices), `detokenize` and `token_text`."""
