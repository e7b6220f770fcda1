"""Wire models: the request and response bodies of the APIs the gateway serves (OpenAI's
completions, chat and models in `openai`, the Responses API in `responses`, `/tokenize` and
`/detokenize` in `tokenize`). Plain pydantic, no serving logic."""
