"""Image inputs: data URLs and markdown images read, PNG/JPEG/WebP/GIF decoded to RGB, limits
held before decoding, and every problem a 422 naming the field (tgis.server.http.images)."""

from __future__ import annotations

import base64
import io
import ipaddress
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anyio
import pytest
from PIL import Image

from tgis.server.http.errors import ApiError
from tgis.server.http.images import (
    ImageLimits,
    UrlPolicy,
    count_images,
    data_url_bytes,
    decode_image,
    fetch_image,
    markdown_images,
    resolved_addresses,
)

LIMITS = ImageLimits()
# Incompressible pixels: cutting their file short leaves a truncated image, not a shorter one.
NOISE = Image.effect_noise((64, 64), 50).convert("RGB")
FIELD = "messages[0].content[1].image_url.url"


def encoded(image: Image.Image, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def picture(size: tuple[int, int] = (7, 5)) -> Image.Image:
    """A small RGB image whose pixels all differ (so that a digest tells images apart)."""
    image = Image.new("RGB", size)
    image.putdata([(x * 30 % 256, y * 40 % 256, (x + y) * 7 % 256) for y in range(size[1])
                   for x in range(size[0])])  # fmt: skip
    return image


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def refusal(call: object, *args: object) -> str:
    with pytest.raises(ApiError) as info:
        call(*args)  # type: ignore[operator]
    assert info.value.status == 422
    return str(info.value)


@pytest.mark.parametrize(
    ("fmt", "options"), [("PNG", {}), ("WEBP", {"lossless": True}), ("GIF", {}), ("JPEG", {})]
)
def test_each_format_decodes_to_rgb(fmt: str, options: dict[str, object]) -> None:
    original = picture()
    data = encoded(original.convert("P") if fmt == "GIF" else original, fmt, **options)
    got = decode_image(data_url_bytes(data_url(data), FIELD, LIMITS), FIELD, LIMITS)
    assert got.image.mode == "RGB" and got.size == (7, 5)
    if fmt in ("PNG", "WEBP"):  # lossless: the same pixels, the same identity
        assert got.image.tobytes() == original.tobytes()
        assert got.digest == decode_image(encoded(original, "PNG"), FIELD, LIMITS).digest


def test_a_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (4, 4), color) for color in ("red", "blue")]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    got = decode_image(out.getvalue(), FIELD, LIMITS)
    assert got.image.getpixel((0, 0)) == (255, 0, 0)


def test_different_pictures_have_different_digests() -> None:
    a = decode_image(encoded(picture(), "PNG"), FIELD, LIMITS)
    b = decode_image(encoded(picture((5, 7)), "PNG"), FIELD, LIMITS)
    assert a.digest != b.digest


def test_data_url_refusals_name_the_field() -> None:
    png = encoded(picture(), "PNG")
    cases = {
        "https://example.com/cat.png": "must be a data URL",
        "data:text/plain;base64,aGVsbG8=": "send image/png, image/jpeg, image/webp or image/gif",
        "data:image/png,rawbytes": "must be base64-encoded",
        "data:image/png;base64,@@@@": "is not valid base64",
    }
    for url, expected in cases.items():
        message = refusal(data_url_bytes, url, FIELD, LIMITS)
        assert FIELD in message and expected in message, message
    small = ImageLimits(max_bytes=len(png) - 1)
    message = refusal(data_url_bytes, data_url(png), FIELD, small)
    assert f"at most {len(png) - 1} bytes" in message and "smaller" in message


def test_an_oversized_image_is_refused_before_it_is_decoded() -> None:
    # 20000 x 20000 of one colour: a few kilobytes of PNG, 1.2 GB once decoded.
    bomb = encoded(Image.new("L", (20_000, 20_000)), "PNG")
    assert len(bomb) < 2_000_000
    message = refusal(decode_image, bomb, FIELD, LIMITS)
    assert "larger than Pillow will open" in message
    assert f"at most {LIMITS.max_pixels} pixels" in message and "resize" in message
    big = encoded(Image.new("L", (5000, 4000)), "PNG")  # past ours, below Pillow's bound
    message = refusal(decode_image, big, FIELD, LIMITS)
    assert "5000x4000 = 20000000 pixels" in message and f"at most {LIMITS.max_pixels}" in message


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"hello, not an image", "is not a PNG, JPEG, WebP or GIF"),
        (encoded(NOISE, "PNG")[:900], "broken image"),
        (encoded(NOISE, "JPEG")[:900], "broken image: image file is truncated"),
        (encoded(picture(), "BMP"), "is not a PNG, JPEG, WebP or GIF"),
    ],
)
def test_broken_and_unsupported_images_are_refused(data: bytes, expected: str) -> None:
    message = refusal(decode_image, data, FIELD, LIMITS)
    assert FIELD in message and expected in message, message


def test_the_image_count_is_limited() -> None:
    count_images(2, ImageLimits(max_images=2))
    message = refusal(count_images, 3, ImageLimits(max_images=2))
    assert "3 images" in message and "at most 2" in message


def test_markdown_images_are_found_in_tgi_inputs() -> None:
    url = data_url(encoded(picture(), "PNG"))
    text = f"Look: ![a cat]({url}) and ![]( {url} ). Not ![this] or [that](x)."
    found = markdown_images(text)
    assert [u for _, _, u in found] == [url, url]
    start, end, _ = found[0]
    assert text[start:end] == f"![a cat]({url})"


# --- remote images (--allow-image-urls) ------------------------------------------------------


class _Images(BaseHTTPRequestHandler):
    """/cat.png; /redirect to wherever ?to= says (to itself without one); /big (no length
    given); anything else a 404."""

    png = b""

    def do_GET(self) -> None:
        path, _, query = self.path.partition("?")
        if path == "/cat.png":
            self._send(200, self.png, {"content-type": "image/png"})
        elif path == "/redirect":
            self._send(302, b"", {"location": query.removeprefix("to=") or "/redirect"})
        elif path == "/big":
            self.send_response(200)
            self.send_header("connection", "close")
            self.end_headers()
            self.wfile.write(b"x" * 5000)
        else:
            self._send(404, b"no", {})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for key, value in {**headers, "content-length": str(len(body))}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    _Images.png = encoded(picture(), "PNG")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


LOOPBACK_ONLY = UrlPolicy(timeout_s=5, allowed=lambda address: address.is_loopback)


def fetched(url: str, policy: UrlPolicy = LOOPBACK_ONLY, limits: ImageLimits = LIMITS) -> bytes:
    return anyio.run(fetch_image, url, FIELD, limits, policy)


def fetch_refusal(url: str, policy: UrlPolicy = LOOPBACK_ONLY, **limits: int) -> str:
    with pytest.raises(ApiError) as info:
        fetched(url, policy, ImageLimits(**limits) if limits else LIMITS)
    assert info.value.status == 422 and FIELD in str(info.value)
    return str(info.value)


def test_a_remote_image_is_fetched_and_decoded(image_host: str) -> None:
    data = fetched(f"{image_host}/cat.png")
    assert decode_image(data, FIELD, LIMITS).image.tobytes() == picture().tobytes()
    # A redirect to an allowed address is followed.
    assert fetched(f"{image_host}/redirect?to={image_host}/cat.png") == data


def test_only_public_addresses_are_fetched_by_default(image_host: str) -> None:
    for url in (f"{image_host}/cat.png", "http://localhost:9/x.png", "http://[::1]:9/x.png"):
        message = fetch_refusal(url, UrlPolicy(timeout_s=5))
        assert "an address this server does not fetch from" in message, url
    for text in ("10.0.0.1", "169.254.169.254", "192.168.1.1", "fc00::1", "::1", "0.0.0.0"):
        assert not UrlPolicy().allowed(ipaddress.ip_address(text)), text
    assert UrlPolicy().allowed(ipaddress.ip_address("8.8.8.8"))
    # An IPv4 address written as IPv6 is judged as itself.
    assert resolved_addresses("::ffff:10.0.0.1", 80) == [ipaddress.ip_address("10.0.0.1")]


def test_redirects_are_checked_hop_by_hop(image_host: str) -> None:
    to_private = f"{image_host}/redirect?to=http://10.1.2.3/cat.png"
    assert "does not fetch from" in fetch_refusal(to_private)
    loop = f"{image_host}/redirect?to={image_host}/redirect"
    assert "more than 3 redirects" in fetch_refusal(loop)


def test_remote_failures_and_limits(image_host: str) -> None:
    assert "answered 404" in fetch_refusal(f"{image_host}/missing")
    assert "is not an http(s) URL" in fetch_refusal("file:///etc/passwd")
    size = len(encoded(picture(), "PNG"))
    declared = fetch_refusal(f"{image_host}/cat.png", max_bytes=size - 1)
    assert f"is {size} bytes" in declared
    assert "at most 1000 bytes" in fetch_refusal(f"{image_host}/big", max_bytes=1000)
    assert "cannot be resolved" in fetch_refusal("http://no-such-host.invalid/x.png")
