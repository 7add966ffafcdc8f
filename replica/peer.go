package replica

import "time"

// WithDefaults returns e with zero fields set to their defaults.
func (e Ejection) WithDefaults() Ejection {
	e.defaults()
	return e
}

// EjectSoft takes r out of rotation from now until until, as soft
// failures do: when every replica a request could use is out, the
// fallback may still use it (Usable). It is for evidence that is not this
// router's own, such as a peer's report; an ejection in place at now is
// left as it is.
func (r *Replica) EjectSoft(now, until time.Time) {
	r.hmu.Lock()
	defer r.hmu.Unlock()
	if now.UnixNano() < r.downUntil.Load() || !until.After(now) {
		return
	}
	r.softOut.Store(true)
	r.downUntil.Store(until.UnixNano())
}
