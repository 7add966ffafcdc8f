package kubedisc

import (
	"net"
	"net/netip"
	"slices"
	"strconv"

	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/semroute/semroute/replica"
)

// fromSlices lists the candidates of the Service's EndpointSlices that
// Kubernetes or a trusted manager wrote.
func (s *Source) fromSlices() ([]candidate, error) {
	objs, err := s.slices.List(s.sliceSel)
	if err != nil {
		return nil, err
	}
	var out []candidate
	for _, o := range objs {
		es := o.(*discoveryv1.EndpointSlice)
		switch mgr := es.Labels[discoveryv1.LabelManagedBy]; {
		case mgr == ControllerManager || mgr == MirroringManager:
			out = s.fromSlice(out, es, true)
		case slices.Contains(s.o.TrustedManagers, mgr):
			out = s.fromSlice(out, es, false)
		}
	}
	return out, nil
}

// fromSlice appends the ready endpoints of an EndpointSlice whose address
// can be a pod's; kube tells whether Kubernetes wrote the slice (else only
// the endpoints naming a pod are read).
func (s *Source) fromSlice(out []candidate, es *discoveryv1.EndpointSlice, kube bool) []candidate {
	port := slicePort(es, s.o.PortName)
	if port == 0 {
		return out
	}
	for _, ep := range es.Endpoints {
		if !endpointReady(ep) {
			continue
		}
		addr, ok := podAddr(ep.Addresses[0], es.AddressType)
		if !ok {
			continue
		}
		pod, ok := s.podRef(ep)
		switch {
		case !ok:
		case pod != "" && kube:
			out = append(out, candidate{s.spec(pod, addr, port), rankPod})
		case pod != "":
			out = append(out, candidate{s.spec(pod, addr, port), rankOtherPod})
		case kube:
			out = append(out, candidate{s.spec(addr, addr, port), rankAddress})
		}
	}
	return out
}

// slicePort is the number of the slice's port named name (its first port
// when name is empty); 0 when there is none.
func slicePort(es *discoveryv1.EndpointSlice, name string) int {
	for _, p := range es.Ports {
		if p.Port != nil && (name == "" || p.Name != nil && *p.Name == name) {
			if n := int(*p.Port); n >= 1 && n <= 65535 {
				return n
			}
			return 0
		}
	}
	return 0
}

// endpointReady reports whether an endpoint has an address and serves:
// not unready, not terminating.
func endpointReady(ep discoveryv1.Endpoint) bool {
	c := ep.Conditions
	return len(ep.Addresses) > 0 && (c.Ready == nil || *c.Ready) && (c.Terminating == nil || !*c.Terminating)
}

// podRef returns the name of the pod an endpoint's targetRef names, ""
// when it names none; ok is false when it names a pod that cannot be one
// of the Source's (another namespace, an invalid name).
func (s *Source) podRef(ep discoveryv1.Endpoint) (pod string, ok bool) {
	ref := ep.TargetRef
	if ref == nil || ref.Kind != "Pod" {
		return "", true
	}
	if ref.Namespace != "" && ref.Namespace != s.o.Namespace || len(validation.IsDNS1123Subdomain(ref.Name)) > 0 {
		return "", false
	}
	return ref.Name, true
}

// podAddr returns addr in its canonical form if it can be a pod's IP: an
// IP literal of family (discoveryv1.AddressTypeIPv4 or IPv6; either when
// empty, for a pod's status.podIP), not unspecified or in 0.0.0.0/8, not
// loopback, link-local, multicast or the broadcast address, not
// IPv4-mapped and without a zone. An FQDN is not.
func podAddr(addr string, family discoveryv1.AddressType) (string, bool) {
	a, err := netip.ParseAddr(addr)
	if err != nil || a.Zone() != "" || a.Is4In6() || !ofFamily(a, family) {
		return "", false
	}
	if a.IsUnspecified() || a.IsLoopback() || a.IsLinkLocalUnicast() || a.IsMulticast() ||
		a.Is4() && (a.As4()[0] == 0 || a == netip.AddrFrom4([4]byte{255, 255, 255, 255})) {
		return "", false
	}
	return a.String(), true
}

// ofFamily reports whether a is of an EndpointSlice's address type: any
// IP when family is empty; none when it is FQDN or unknown.
func ofFamily(a netip.Addr, family discoveryv1.AddressType) bool {
	switch family {
	case "":
		return true
	case discoveryv1.AddressTypeIPv4:
		return a.Is4()
	case discoveryv1.AddressTypeIPv6:
		return a.Is6()
	}
	return false
}

// spec is the replica name serving at addr (an IP, canonical) on port.
func (s *Source) spec(name, addr string, port int) replica.Spec {
	return replica.Spec{Name: name, URL: s.o.Scheme + "://" + net.JoinHostPort(addr, strconv.Itoa(port)), BudgetTokens: s.o.BudgetTokens}
}
