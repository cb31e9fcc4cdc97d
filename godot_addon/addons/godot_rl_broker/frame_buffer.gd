extends RefCounted
## Splits the bytes read from the broker into frame bodies (u32 little-endian length, then body).
##
## The declared length is checked against max_frame_bytes as soon as the 4 header bytes are in,
## before the body is buffered, so a corrupt header never makes the game hold a huge buffer.

const Wire := preload("wire.gd")

var max_frame_bytes: int = Wire.DEFAULT_MAX_FRAME_BYTES
## Why the stream is unusable; "" while it is fine. Once set, pop() returns nothing more.
var error: String = ""

var _buffer := PackedByteArray()


func feed(data: PackedByteArray) -> void:
	if error.is_empty():
		_buffer.append_array(data)


## Bytes held that are not yet a whole frame.
func buffered_bytes() -> int:
	return _buffer.size()


## The next complete body, or an empty array until more bytes arrive (or once `error` is set).
func pop() -> PackedByteArray:
	if not error.is_empty() or _buffer.size() < Wire.HEADER_BYTES:
		return PackedByteArray()
	var length: int = _buffer.decode_u32(0)
	if length > max_frame_bytes:
		error = "the broker announced a %d-byte frame; the limit is %d" % [length, max_frame_bytes]
		_buffer.clear()
		return PackedByteArray()
	if length == 0:
		error = "the broker sent an empty frame"
		_buffer.clear()
		return PackedByteArray()
	var end: int = Wire.HEADER_BYTES + length
	if _buffer.size() < end:
		return PackedByteArray()
	var body: PackedByteArray = _buffer.slice(Wire.HEADER_BYTES, end)
	_buffer = _buffer.slice(end)
	return body
