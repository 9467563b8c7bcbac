"""Upstream's text-generation HTTP endpoint on the standard library: `PUT /api` with a JSON body (see
`generation_request`) answers upstream's response (see `text_generation`), or 400 with `{"message": ...}`.
`POST /v1/completions` answers OpenAI's text completion requests (see `completion_request`, `text_completion`), and
with a chat format `POST /v1/chat/completions` OpenAI's chat requests (see `chat_request`, `chat_completion`).

Rank 0 serves HTTP. Every request it accepts is checked and tokenized there first (a bad request reaches no other
rank), then broadcast to all ranks as a `GenerationJob`; every rank runs it (the tensor- and pipeline-parallel ranks
together; data-parallel replicas, if any, generate the same batches) and rank 0 answers with the results every
rank gets (the last pipeline stage's tokens and log-probabilities). The other ranks wait in
`follow_requests` until rank 0 broadcasts the stop signal (`TextGenerationServer.stop_followers`) or they are
interrupted. Requests are handled one at a time (a lock), as upstream does.
"""

import datetime
import json
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch.distributed as dist

from megatron.inference.chat_completion import build_chat_completion, prepare_chat_job
from megatron.inference.chat_request import EXAMPLE_BODY as CHAT_EXAMPLE_BODY
from megatron.inference.chat_request import parse_chat_request
from megatron.inference.completion_request import EXAMPLE_BODY as COMPLETION_EXAMPLE_BODY
from megatron.inference.completion_request import parse_completion_request
from megatron.inference.generation_request import RequestError, parse_generation_request
from megatron.inference.text_completion import build_text_completion, prepare_completion_job
from megatron.inference.text_generation import GenerationLimits, build_response, prepare_job, run_job
from megatron.training.tokenizer.chat_prompt_formats import PROMPT_FORMATS

API_PATH = "/api"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# Each endpoint's method and an example of its body (a request with another method is answered with it).
ENDPOINTS = {
    API_PATH: ("PUT", '{"prompts": ["Hello"]}'),
    CHAT_COMPLETIONS_PATH: ("POST", CHAT_EXAMPLE_BODY),
    COMPLETIONS_PATH: ("POST", COMPLETION_EXAMPLE_BODY),
}
NO_CHAT_FORMAT = (f"POST {CHAT_COMPLETIONS_PATH} needs the model's chat format: launch the server with "
                  f"--chat-prompt-format FORMAT ({', '.join(sorted(PROMPT_FORMATS))}), the format the model was "
                  "fine-tuned with (its --sft-tokenizer-prompt-format)")
_STOP = "stop"
# The largest request body read (128 prompts of 2560 tokens take a few MiB of JSON); a larger declared size is
# refused before anything is read, so a bad Content-Length cannot make the server allocate it.
MAX_REQUEST_BYTES = 64 * 2 ** 20


class RequestTooLarge(ValueError):
    """A request body past MAX_REQUEST_BYTES (answered with 413)."""


def _check_body_size(size: int):
    if size > MAX_REQUEST_BYTES:
        raise RequestTooLarge(f"the request body ({size} bytes) is larger than the {MAX_REQUEST_BYTES} bytes this "
                              "server reads: send fewer or shorter prompts")


def _world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def broadcast_from_rank0(job=None):
    """Rank 0's `job` (a GenerationJob or the stop signal) on every rank."""
    if _world_size() == 1:
        return job
    holder = [job]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def follow_requests(model, limits: GenerationLimits):
    """Run every job rank 0 broadcasts, until it broadcasts the stop signal (the ranks other than 0). A job that
    fails is reported and the rank keeps following: rank 0 answers that request with a 500 and serves the next."""
    while True:
        job = broadcast_from_rank0()
        if job == _STOP:
            return
        try:
            run_job(model, job, limits)
        except Exception as error:  # the same job failed on rank 0, which answers it; wait for the next one
            print(f"rank {dist.get_rank() if dist.is_initialized() else 0}: generation failed: {error!r}", flush=True)


class TextGenerationServer:
    """Rank 0's side: answers requests (`generate`, `chat_completion`, `completion`; `handle`, `handle_chat`,
    `handle_completion`) and serves them over HTTP (`serve`). `chat_format` (a `ChatPromptFormat`; None: no chat
    endpoint) renders chat requests, and `model_name` is the `model` of the OpenAI endpoints' answers."""

    def __init__(self, model, tokenizer, limits: GenerationLimits, chat_format=None, model_name="megatron-gpt"):
        self.model = model
        self.tokenizer = tokenizer
        self.limits = limits
        self.chat_format = chat_format
        self.model_name = model_name
        self.lock = threading.Lock()

    def _run(self, job, body, log: bool):
        """Every rank's results of `job`: broadcast to the other ranks, then run here (one request at a time)."""
        with self.lock:
            if log:
                print(f"request: {json.dumps(body)}\nstart time: {datetime.datetime.now()}", flush=True)
            broadcast_from_rank0(job)
            results = run_job(self.model, job, self.limits)
            if log:
                print(f"end time: {datetime.datetime.now()}", flush=True)
        return results

    def generate(self, body) -> dict:
        """The response to a `PUT /api` body; raises RequestError for a bad one (before any rank does work)."""
        request = parse_generation_request(body)
        job = prepare_job(request, self.tokenizer, self.limits)
        results = self._run(job, body, log=not request.no_log)
        return build_response(job, results, self.tokenizer, self.limits.eod_id)

    def chat_completion(self, body) -> dict:
        """The response to a `POST /v1/chat/completions` body; raises RequestError for a bad one (before any rank
        does work), or when the server has no chat format."""
        if self.chat_format is None:
            raise RequestError(NO_CHAT_FORMAT)
        request = parse_chat_request(body)
        job = prepare_chat_job(request, self.tokenizer, self.limits, self.chat_format)
        [result] = self._run(job, body, log=True)
        return build_chat_completion(job, result, self.tokenizer, self.limits.eod_id, self.chat_format,
                                     self.model_name)

    def completion(self, body) -> dict:
        """The response to a `POST /v1/completions` body; raises RequestError for a bad one (before any rank does
        work)."""
        request = parse_completion_request(body)
        job = prepare_completion_job(request, self.tokenizer, self.limits)
        results = self._run(job, body, log=True)
        return build_text_completion(request, job, results, self.tokenizer, self.model_name)

    def handle(self, body):
        """(HTTP status, JSON payload) for a `PUT /api` body."""
        return _answer(self.generate, body)

    def handle_chat(self, body):
        """(HTTP status, JSON payload) for a `POST /v1/chat/completions` body."""
        return _answer(self.chat_completion, body)

    def handle_completion(self, body):
        """(HTTP status, JSON payload) for a `POST /v1/completions` body."""
        return _answer(self.completion, body)

    def stop_followers(self):
        """Release the other ranks from `follow_requests` (once, when serving ends)."""
        with self.lock:
            broadcast_from_rank0(_STOP)

    def make_http_server(self, host: str, port: int) -> ThreadingHTTPServer:
        """An HTTP server bound to (host, port) (port 0: a free one, `server.server_address[1]`); the caller
        runs `serve_forever()`."""
        http_server = ThreadingHTTPServer((host, port), _handler_class(self))
        http_server.daemon_threads = True
        return http_server

    def serve(self, host: str = "0.0.0.0", port: int = 5000):
        """Serve until interrupted (Ctrl-C reaches every rank of a torchrun job, so the other ranks stop too)."""
        http_server = self.make_http_server(host, port)
        print(f"serving text generation on http://{host}:{http_server.server_address[1]}{API_PATH} (PUT)",
              flush=True)
        print(f"serving text completions on http://{host}:{http_server.server_address[1]}{COMPLETIONS_PATH} (POST)",
              flush=True)
        if self.chat_format is not None:
            print(f"serving chat completions ({self.chat_format.name}) on "
                  f"http://{host}:{http_server.server_address[1]}{CHAT_COMPLETIONS_PATH} (POST)", flush=True)
        try:
            http_server.serve_forever()
        finally:
            http_server.server_close()


def _answer(respond, body):
    """(HTTP status, JSON payload): `respond(body)`'s, or the error's."""
    try:
        return HTTPStatus.OK, respond(body)
    except RequestError as error:
        return HTTPStatus.BAD_REQUEST, {"message": str(error)}
    except Exception as error:  # answer the client; the server keeps serving
        return HTTPStatus.INTERNAL_SERVER_ERROR, {"message": f"generation failed: {error!r}"}


def _handler_class(server: TextGenerationServer):
    handlers = {API_PATH: server.handle, CHAT_COMPLETIONS_PATH: server.handle_chat,
                COMPLETIONS_PATH: server.handle_completion}

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status, payload):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _serve_request(self):
            path = self.path.rstrip("/")
            if path not in ENDPOINTS:
                endpoints = " or ".join(f"{method} {endpoint}" for endpoint, (method, _) in ENDPOINTS.items())
                return self._reply(HTTPStatus.NOT_FOUND, {"message": f"no endpoint {self.path}: use {endpoints}"})
            method, example = ENDPOINTS[path]
            if self.command != method:
                return self._reply(HTTPStatus.METHOD_NOT_ALLOWED,
                                   {"message": f"use {method} {path} with a JSON body, such as {example}"})
            try:
                data = self._read_body()
            except RequestTooLarge as error:
                self.close_connection = True  # the body is left unread
                return self._reply(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"message": str(error)})
            except ValueError as error:
                return self._reply(HTTPStatus.BAD_REQUEST, {"message": str(error)})
            try:
                body = json.loads(data or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                return self._reply(HTTPStatus.BAD_REQUEST, {"message": f"the request body is not JSON: {error}"})
            self._reply(*handlers[path](body))

        def _read_body(self) -> bytes:
            """The request's body, sent with a Content-Length or chunked; ValueError when the framing is bad,
            RequestTooLarge past MAX_REQUEST_BYTES."""
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                chunks, received = [], 0
                while True:
                    size_line = self.rfile.readline().split(b";")[0].strip()
                    try:
                        size = int(size_line, 16)
                    except ValueError:
                        raise ValueError(f"bad chunk size {size_line!r} in the chunked request body") from None
                    if size < 0:
                        self.close_connection = True  # the body's end is unknown
                        raise ValueError(f"bad chunk size {size_line!r} in the chunked request body: a chunk "
                                         "size is a non-negative hexadecimal number")
                    if size == 0:
                        while self.rfile.readline().strip():  # trailer lines up to the blank line
                            pass
                        return b"".join(chunks)
                    received += size
                    _check_body_size(received)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            length = self.headers.get("Content-Length") or "0"
            if not length.strip().isdigit():
                self.close_connection = True  # the body's end is unknown
                raise ValueError(f"Content-Length must be a non-negative integer, got {length!r}")
            _check_body_size(int(length))
            return self.rfile.read(int(length))

        do_GET = do_PUT = do_POST = do_DELETE = do_PATCH = _serve_request

        def log_message(self, format, *args):
            pass  # requests are logged by TextGenerationServer._run (unless no_log)

    return Handler
