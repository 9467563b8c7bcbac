"""Interactive client of tools/run_text_generation_server.py (upstream's `text_generation_cli.py`):

    python tools/text_generation_cli.py localhost:5000

asks for a prompt and a number of tokens, sends `PUT /api` with {"prompts": [prompt], "tokens_to_generate": N}
and prints the text (the prompt and its continuation); end with Ctrl-D. Standard library only.
"""

import http.client
import json
import sys
import urllib.error
import urllib.request


def api_url(address: str) -> str:
    """`host:port` (upstream's argument) or a full URL -> the endpoint's URL."""
    url = address if "://" in address else "http://" + address
    _, _, rest = url.partition("://")
    if "/" not in rest:
        url += "/api"
    return url


def build_request(prompt: str, tokens_to_generate: int) -> dict:
    return {"prompts": [prompt], "tokens_to_generate": tokens_to_generate}


def send_request(url: str, body: dict, timeout: float = 600.0):
    """(HTTP status, decoded JSON body) of `PUT url` with `body` as JSON."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="PUT",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        payload = error.read()
        try:
            return error.code, json.loads(payload)
        except json.JSONDecodeError:
            return error.code, {"message": payload.decode(errors="replace")}


def main(argv=None, read=input, write=print):
    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: python tools/text_generation_cli.py HOST:PORT   (for example localhost:5000)"
    if argv in (["-h"], ["--help"]):
        write(usage)
        write(__doc__.strip())
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        write(usage)
        return 2
    url = api_url(argv[0])
    while True:
        try:
            prompt = read("Enter prompt: ")
            answer = read("Enter number tokens to generate: ")
        except (EOFError, KeyboardInterrupt):
            write("")
            return 0
        try:
            tokens_to_generate = int(answer)
        except ValueError:
            write(f"tokens to generate must be an integer, got {answer!r}")
            continue
        try:
            status, payload = send_request(url, build_request(prompt, tokens_to_generate))
        except urllib.error.URLError as error:
            write(f"cannot reach {url}: {error.reason}")
            continue
        except (http.client.HTTPException, OSError) as error:  # the server closed or reset the connection
            write(f"no answer from {url}: {error!r}; is the server still running?")
            continue
        if status != 200:
            write(f"Error {status}: {payload.get('message', payload)}")
        else:
            write("Megatron Response: ")
            write(payload["text"][0])


if __name__ == "__main__":
    sys.exit(main())
