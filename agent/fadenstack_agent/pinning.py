"""TLS to the console with its certificate pinned: the console gives its certificate's SHA-256 (of the DER
form, 64 hex digits) over SSH, at enrolment and when the heartbeat starts, and every connection to it
(heartbeats, the first copies of images and model files) refuses any other certificate before a byte of the
request (its token) is sent.

No certificate authority takes part: the console's certificate is self-signed and the pin is the trust.
Without a pin an https:// URL is checked the usual way (the system's authorities and the host name).
"""

import hashlib
import hmac
import http.client
import re
import ssl
import urllib.request

from .protocol import BAD_INPUT, AgentError

PIN = re.compile(r"^[0-9a-f]{64}$")


class PinMismatch(ssl.SSLError):
    """The server showed another certificate than the pinned one."""


def parse_pin(text) -> str:
    """A pin as given (``sha256:`` prefix and colons allowed, any case) -> 64 lower-case hex digits."""
    pin = str(text or "").strip().lower()
    if pin.startswith("sha256:"):
        pin = pin[len("sha256:"):]
    pin = pin.replace(":", "")
    if not PIN.match(pin):
        raise AgentError(BAD_INPUT, "--pin must be the SHA-256 of the console's certificate (64 hex digits), got %r"
                         % (text,))
    return pin


def pinned_context() -> ssl.SSLContext:
    """A client context that checks nothing by itself: ``check_pin`` does, on every connection."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def check_pin(sock, pin: str) -> None:
    der = sock.getpeercert(binary_form=True) or b""
    seen = hashlib.sha256(der).hexdigest()
    if not hmac.compare_digest(seen, pin):
        raise PinMismatch("the console's certificate is not the one pinned at enrolment (sha256 %s, expected %s): "
                          "enrol the machine again if the console's certificate changed" % (seen, pin))


class PinnedHTTPSConnection(http.client.HTTPSConnection):
    """``http.client.HTTPSConnection`` that refuses, once connected, any certificate but the pinned one."""

    def __init__(self, host, port=None, *, pin: str, **kwargs):
        kwargs["context"] = pinned_context()
        super().__init__(host, port, **kwargs)
        self.pin = pin

    def connect(self):
        super().connect()
        try:
            check_pin(self.sock, self.pin)
        except PinMismatch:
            self.close()
            raise


class PinnedHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, pin: str):
        super().__init__(context=pinned_context())
        self.pin = pin

    def https_open(self, req):
        return self.do_open(self._connection, req)

    def _connection(self, host, **kwargs):
        kwargs.pop("context", None)
        kwargs.pop("check_hostname", None)  # given by Python before 3.12
        return PinnedHTTPSConnection(host, pin=self.pin, **kwargs)


def connection_class(https: bool, pin: str = ""):
    """What to open a connection with: plain, https checked the usual way, or https to a pinned certificate."""
    if not https:
        return http.client.HTTPConnection
    if pin:
        return lambda host, port=None, **kwargs: PinnedHTTPSConnection(host, port, pin=pin, **kwargs)
    return http.client.HTTPSConnection
