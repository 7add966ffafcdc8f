package router

import (
	"context"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/limits"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
)

// Arrival is a request as a front door received it, translated from its
// protocol: the steps from here to its placement (Admit, then Place) are
// the same for every door.
type Arrival struct {
	// API is the API of Body.
	API blockhash.Endpoint
	// Body is the request's OpenAI or Anthropic body; ContentType its
	// Content-Type header ("" for none: JSON).
	Body        []byte
	ContentType string
	// Parsed, instead of Body, is a request the door built itself (the
	// gRPC API's messages, prompt, token ids or blocks), estimated;
	// PreSplit says its parts are blocks whose kinds the caller gave.
	Parsed   *blockhash.Request
	PreSplit bool
	// Session and Tenant identify the caller (HeaderSessionID,
	// HeaderTenantID, or the gRPC request's fields).
	Session, Tenant string
	// Header reads the request's priority and fairness headers (nil:
	// none): its priority, and its flow within the priority (placement).
	// Priorities maps an objective's name to its priority
	// (ServerOptions.Priorities).
	Header     func(string) string
	Priorities map[string]int
	// Route names the door's route for metrics ("chat", "ext_proc", …).
	Route string
	// Ctx bounds the precise mode's /tokenize call and, in Place, the
	// request's wait in the router's queue.
	Ctx context.Context
	// Bytes is the request's size against the queue's bound; 0: Body's.
	Bytes int64
	// DryRun decides without recording anything (gRPC's dry_run).
	DryRun bool
	// Disaggregates says the door can send a prefill replica its part of
	// a disaggregated request (HTTP and the endpoint picker; not the gRPC
	// API, whose caller gets one replica).
	Disaggregates bool
}

// Admission is an admitted request: the core's request, ready for Place,
// and its parse, which the door reads to make the body it forwards. The
// caller must Recycle it once it has.
type Admission struct {
	CoreRequest
	Parsed *blockhash.Request
}

// Recycle releases the admission's parse.
func (a *Admission) Recycle() { a.Parsed.Recycle() }

// Admit checks and reads a request the same way for every front door: its
// body's type and encoding, its parse within lim's bounds, the output
// tokens it asks for, its input for the engine (its token ids in precise
// mode, else the estimate; routing.Request), its tenant's priority and
// flow, and the replica that holds the stored response it continues. A
// request refused says why: an error classify turns into the client's
// answer (a *blockhash.InputError, *apiError, blockhash.ErrBusy). Admit
// owns a.Parsed: refused, it is recycled; admitted, the Admission's.
func (c *Core) Admit(a Arrival, lim *limits.Request) (*Admission, error) {
	req, err := parseArrival(a, lim)
	if err != nil {
		return nil, err
	}
	if e := maxTokensError(req.MaxTokens, lim); e != nil {
		req.Recycle()
		return nil, e
	}
	ad := &Admission{Parsed: req, CoreRequest: CoreRequest{Model: req.Model, Session: a.Session, Tenant: a.Tenant,
		Route: a.Route, API: a.API, Ctx: a.Ctx, Bytes: a.Bytes, DryRun: a.DryRun}}
	var allow func(*replica.Replica) bool
	if id := req.PreviousResponseID; id != "" {
		var refused bool
		allow, refused = c.ids.home(id, a.Tenant) // the replica that stored the response it continues
		if refused {
			req.Recycle()
			return nil, &errNotYours
		}
	}
	if a.API == blockhash.Responses && a.Parsed == nil {
		c.continueChain(cmpCtx(a.Ctx), req, &ad.CoreRequest)
	}
	if a.PreSplit {
		ad.Input = preSplit(c.e, c.o.LogPrompts, req, a.Session)
	} else {
		ad.Input = c.prepare(cmpCtx(a.Ctx), req, a.Body, a.Session)
	}
	ad.Input.DetachText() // the decision may outlive the parsed body (the gRPC API's, a log of prompts)
	ad.Input.Allow, ad.Input.Home = allow, allow != nil
	get := a.Header
	if get == nil {
		get = func(string) string { return "" }
	}
	ad.Priority, ad.Flow = placement(a.Priorities, get, a.Tenant, req.User)
	ad.Deadline = objectiveTarget(c.o.TTFTTargets, get)
	if ad.Bytes == 0 {
		ad.Bytes = int64(len(a.Body))
	}
	ad.Disaggregate = a.Disaggregates && chatLike(a.API) && disaggregated(c.e.Pool(), req.Model)
	return ad, nil
}

// parseArrival returns a's request: Parsed, or Body parsed as API within lim
// once its content type and encoding are checked.
func parseArrival(a Arrival, lim *limits.Request) (*blockhash.Request, error) {
	if a.Parsed != nil {
		return a.Parsed, nil
	}
	if e := checkBodyType(a.ContentType, a.Body); e != nil {
		return nil, e
	}
	return blockhash.Parse(a.API, a.Body, lim.Parse)
}

// preSplit makes the engine's input of pre-split blocks: each keeps the
// kind the caller gave, whatever the heuristics would say. Their text is
// kept for e's matcher, or when prompts are logged.
func preSplit(e *routing.Engine, logPrompts bool, req *blockhash.Request, session string) routing.Request {
	var ri routing.Request
	h := blockhash.Seed(req.Model)
	for i := range req.Parts {
		n := len(ri.Blocks)
		ri.Blocks = e.Splitter().AppendPart(ri.Blocks, h, &req.Parts[i])
		for j := n; j < len(ri.Blocks); j++ {
			ri.Blocks[j].Kind = req.Parts[i].Base
		}
		h = ri.Blocks[len(ri.Blocks)-1].Hash
		if logPrompts || e.HasMatcher() {
			ri.Text = append(ri.Text, req.Parts[i].Text)
		}
	}
	ri.Key = routing.SessionKey(session, "", ri.Blocks)
	ri.Model = req.Model
	return ri
}

// continueChain makes req, a Responses request, the whole prompt the
// engine renders for it (chains.go): the conversation of the response it
// continues before its own input, when that is known, and sets cr's
// chain (what the engine will store for its answer) and Unknown.
func (c *Core) continueChain(ctx context.Context, req *blockhash.Request, cr *CoreRequest) {
	var prev *responseChain
	if id := req.PreviousResponseID; id != "" {
		var known bool
		if prev, known = c.chains.get(id); !known && c.o.ShareChain != nil {
			prev, known = c.chains.wait(ctx, id, ChainWait) // a peer's record may be on its way
		}
		if !known {
			cr.Unknown = true
			c.o.Metrics.chain("unknown")
			return // neither the prompt nor what the engine stores is known
		}
		c.o.Metrics.chain("known")
	}
	if prev == nil && req.NoStore {
		return // nothing before it, nothing kept after
	}
	parts, d := continued(req, prev)
	req.Parts = parts
	if !req.NoStore {
		cr.chain = d
	}
}

// cmpCtx returns ctx, or the background context for nil.
func cmpCtx(ctx context.Context) context.Context {
	if ctx == nil {
		return context.Background()
	}
	return ctx
}
