extends RefCounted
## Step frames without var_to_bytes() in the steady state. A game's step messages keep one layout
## (the same groups, keys, dtypes and shapes) and differ only in the tick and the array data, as
## long as no episode ended and no agent has info. The first such step is encoded by the engine
## (var_to_bytes, as every other message), and where its tick and data bytes sit is found by
## encoding it again with each of them changed; later steps of that layout are its constant bytes
## with their tick and data put in between: the same bytes, at a fraction of the cost
## (var_to_bytes walks every key String twice). Anything else, or a layout that does not check
## out byte for byte, is encoded by var_to_bytes.

const Wire := preload("wire.gd")
const INT32_MIN: int = -(1 << 31)
const INT32_MAX: int = (1 << 31) - 1
## A step's keys in a steady group; any other key (final, infos) means var_to_bytes.
const STEADY_GROUP_KEYS: int = 4

## The constant bytes around the regions: _chunks[0], region 0, _chunks[1], ..., _chunks[n].
var _chunks: Array[PackedByteArray] = []
var _region_sizes := PackedInt64Array()
## -1: not learned yet; 0: this game's steps do not fit (always var_to_bytes); 1: learned.
var _learned: int = -1


## The frame (length header and body) of a step message, as Wire.encode_message would write it.
func encode(message: Dictionary) -> PackedByteArray:
	var regions: Array = _regions(message)
	if regions.is_empty() or _learned == 0:
		return Wire.encode_message(message)
	if _learned == -1:
		_learn(message, regions)
		return Wire.encode_message(message)
	if regions.size() != _region_sizes.size():
		return Wire.encode_message(message)
	var frame: PackedByteArray = _chunks[0].duplicate()
	for i in regions.size():
		var region: PackedByteArray = regions[i]
		if region.size() != _region_sizes[i]:
			return Wire.encode_message(message)
		frame.append_array(region)
		frame.append_array(_chunks[i + 1])
	return frame


## True once steady steps skip var_to_bytes (for tests).
func is_learned() -> bool:
	return _learned == 1


## The tick's int32 bytes, then every array's data in message order; [] when not a steady step.
func _regions(message: Dictionary) -> Array:
	var tick: int = int(message.get("tick", 0))
	if tick < INT32_MIN or tick > INT32_MAX:  # var_to_bytes would write 64 bits
		return []
	var tick_bytes := PackedByteArray()
	tick_bytes.resize(4)
	tick_bytes.encode_s32(0, tick)
	var regions: Array = [tick_bytes]
	var groups: Dictionary = message["groups"]
	for policy in groups:
		var group: Dictionary = groups[policy]
		if group.size() != STEADY_GROUP_KEYS:
			return []
		var obs: Dictionary = group["obs"]
		for key in obs:
			regions.append(obs[key]["data"])
		regions.append(group["reward"]["data"])
		regions.append(group["terminated"]["data"])
		regions.append(group["truncated"]["data"])
	return regions


## The same places in a copy of the message, as [Dictionary, key] pairs (tick first).
func _slots(message: Dictionary) -> Array:
	var slots: Array = [[message, "tick"]]
	var groups: Dictionary = message["groups"]
	for policy in groups:
		var group: Dictionary = groups[policy]
		for key in group["obs"]:
			slots.append([group["obs"][key], "data"])
		for key in ["reward", "terminated", "truncated"]:
			slots.append([group[key], "data"])
	return slots


func _learn(message: Dictionary, regions: Array) -> void:
	_learned = 0
	var copy: Dictionary = message.duplicate(true)
	var slots: Array = _slots(copy)
	for i in slots.size():
		_fill(slots[i], regions[i].size(), 0)
	var base: PackedByteArray = Wire.encode_message(copy)
	var offsets: Array[int] = []
	for i in slots.size():
		_fill(slots[i], regions[i].size(), 1)
		var changed: PackedByteArray = Wire.encode_message(copy)
		_fill(slots[i], regions[i].size(), 0)
		var offset: int = _changed_run(base, changed, regions[i].size())
		if offset < 0 or (not offsets.is_empty() and offset < offsets[-1] + regions[i - 1].size()):
			return
		offsets.append(offset)
	_chunks.clear()
	_region_sizes.clear()
	var at: int = 0
	for i in offsets.size():
		_chunks.append(base.slice(at, offsets[i]))
		_region_sizes.append(regions[i].size())
		at = offsets[i] + regions[i].size()
	_chunks.append(base.slice(at))
	_learned = 1
	var frame: PackedByteArray = encode(message)
	if frame != Wire.encode_message(message):  # the layout must give the engine's very bytes
		_learned = 0


## Sets a slot to `size` bytes of 0 (filler 0) or of a value differing in every byte (filler 1).
func _fill(slot: Array, size: int, filler: int) -> void:
	var holder: Dictionary = slot[0]
	if slot[1] == "tick":
		holder["tick"] = 0x01010101 * filler
		return
	var data := PackedByteArray()
	data.resize(size)
	data.fill(0xFF * filler)
	holder["data"] = data


## Where `changed` differs from `base` in exactly one run of `size` bytes; -1 otherwise.
func _changed_run(base: PackedByteArray, changed: PackedByteArray, size: int) -> int:
	if base.size() != changed.size() or size <= 0:
		return -1
	var first: int = -1
	var count: int = 0
	for i in base.size():
		if base[i] != changed[i]:
			if first < 0:
				first = i
			count += 1
	if first < 0 or count != size:
		return -1
	for i in range(first, first + size):
		if base[i] == changed[i]:
			return -1
	return first
