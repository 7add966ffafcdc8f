// Package mix scrambles 64-bit keys for the project's hash indexes.
package mix

// Fmix64 is murmur3's 64-bit finalizer: a bijection of the 64-bit words
// (0 maps to 0) whose every output bit depends on every input bit, so that
// any slice of its bits will do as a table index. Callers xor in a random
// seed first, so that keys chosen from outside cannot be made to collide.
func Fmix64(k uint64) uint64 {
	k ^= k >> 33
	k *= 0xff51afd7ed558ccd
	k ^= k >> 33
	k *= 0xc4ceb9fe1a85ec53
	k ^= k >> 33
	return k
}
