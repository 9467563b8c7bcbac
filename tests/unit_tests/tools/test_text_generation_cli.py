"""tools/text_generation_cli.py against a stub server: upstream's `host:port` argument, the PUT request it sends,
and what it prints for an answer and for an error."""

import importlib.util
import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))
_spec = importlib.util.spec_from_file_location("text_generation_cli",
                                               os.path.join(REPO_ROOT, "tools", "text_generation_cli.py"))
cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cli)


class StubHandler(BaseHTTPRequestHandler):
    """Records each request; answers 400 for 0 tokens, else the prompt followed by "!" per token."""
    requests = []

    def do_PUT(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StubHandler.requests.append((self.command, self.path, self.headers["Content-Type"], body))
        if body["tokens_to_generate"] == 0:
            status, payload = 400, {"message": "tokens_to_generate=0 implies logprobs should be True"}
        else:
            status, payload = 200, {"text": [body["prompts"][0] + "!" * body["tokens_to_generate"]]}
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args):
        pass


@pytest.fixture
def stub_address():
    StubHandler.requests = []
    server = HTTPServer(("127.0.0.1", 0), StubHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_api_url_accepts_upstreams_host_port_and_full_urls():
    assert cli.api_url("localhost:5000") == "http://localhost:5000/api"
    assert cli.api_url("http://10.0.0.2:5000") == "http://10.0.0.2:5000/api"
    assert cli.api_url("http://host:80/api") == "http://host:80/api"


def test_cli_sends_put_api_and_prints_the_text_or_the_error(stub_address):
    answers = iter(["Hello", "3", "Bye", "0", "x", "many"])
    printed = []

    def read(question):
        printed.append(question)
        try:
            return next(answers)
        except StopIteration:
            raise EOFError from None

    assert cli.main([stub_address], read=read, write=printed.append) == 0
    assert StubHandler.requests == [
        ("PUT", "/api", "application/json", {"prompts": ["Hello"], "tokens_to_generate": 3}),
        ("PUT", "/api", "application/json", {"prompts": ["Bye"], "tokens_to_generate": 0}),
    ]
    assert printed == [
        "Enter prompt: ", "Enter number tokens to generate: ", "Megatron Response: ", "Hello!!!",
        "Enter prompt: ", "Enter number tokens to generate: ",
        "Error 400: tokens_to_generate=0 implies logprobs should be True",
        "Enter prompt: ", "Enter number tokens to generate: ", "tokens to generate must be an integer, got 'many'",
        "Enter prompt: ", "",
    ]


def test_cli_needs_the_address():
    printed = []
    assert cli.main([], write=printed.append) == 2
    assert "HOST:PORT" in printed[0]


def test_a_connection_closed_without_an_answer_is_reported_and_the_cli_goes_on():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def accept_and_close():
        connection, _ = listener.accept()
        connection.recv(65536)
        connection.close()

    thread = threading.Thread(target=accept_and_close, daemon=True)
    thread.start()
    answers = iter(["Hello", "3"])
    printed = []

    def read(question):
        try:
            return next(answers)
        except StopIteration:
            raise EOFError from None

    try:
        assert cli.main([f"127.0.0.1:{port}"], read=read, write=printed.append) == 0
    finally:
        thread.join(timeout=10)
        listener.close()
    assert printed == [f"no answer from http://127.0.0.1:{port}/api: RemoteDisconnected('Remote end closed connection "
                       "without response'); is the server still running?", ""]
